"""Tensor parallelism over torch.distributed: the process group (`group.py`), the vocab-parallel
and row-parallel modules (`parallel_modules.py`), the sharding of a loaded model
(`sharding.py`), a bounded multi-process launcher (`spawn.py`), and the engine's ranks: their
process groups (`context.py`), the per-step broadcast (`step_broadcast.py`), the loop of a rank
other than 0 (`worker.py`) and rank 0's side (`launcher.py`)."""
