"""Tensor parallelism over torch.distributed: the process group (`group.py`), the vocab-parallel
and row-parallel modules (`parallel_modules.py`), the sharding of a loaded model
(`sharding.py`), and a bounded multi-process launcher (`spawn.py`)."""
