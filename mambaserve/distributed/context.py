"""What a rank of a tensor-parallel engine holds besides its model: its process groups and the
step channel. Three groups, made in the same order on every rank:

- the model's group (the default group: NCCL on CUDA, gloo on a CPU), for the forward's
  all-reduces / all-gathers and the sampled tokens' broadcast, with a bounded timeout;
- `host`: gloo with the same bounded timeout, for rank 0's rare host-side questions to every
  rank (agreeing on pool sizes, gathering memory reports and sync audits);
- `steps`: gloo with a long timeout, for the per-step broadcast (step_broadcast.py), on which the
  other ranks wait while the engine is idle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mambaserve.distributed.group import TPGroup, init_tp
from mambaserve.distributed.step_broadcast import StepChannel

TIMEOUT_ENV = "MAMBASERVE_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
IDLE_TIMEOUT = timedelta(days=3650)  # the other ranks wait this long for the next step


def collective_timeout_s() -> float:
    """Seconds a collective may wait for a peer before it raises (MAMBASERVE_TP_TIMEOUT_S)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


@dataclass
class TPContext:
    tp: TPGroup
    host: dist.ProcessGroup | None  # None: the default group (gloo already)
    channel: StepChannel

    @classmethod
    def join(cls, rank: int, world_size: int, init_method: str, backend: str,
             timeout_s: float) -> TPContext:
        """Join the process group as `rank` and make the side groups (collective on every
        rank). `init_method`: "file://...", "tcp://host:port" or "env://" (torchrun)."""
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group is already initialized in "
                               "this process: one tensor-parallel engine per process")
        tp = init_tp(rank, world_size, init_method, backend, timeout_s)
        host = None if backend == "gloo" else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s))
        steps = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        return cls(tp, host, StepChannel(steps, rank))

    def agree(self, slots: int, pages: int) -> tuple[int, int]:
        """The least (state slots, KV pages) over the ranks: every rank's pools hold as many."""
        t = torch.tensor([slots, pages], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host)
        return int(t[0]), int(t[1])

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
        out = [None] * self.tp.tp_size if self.tp.tp_rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.host)
        return out


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank that is `local_rank` on its host: "cuda" / "cuda:N" -> the
    local_rank-th GPU from 0 / from N; "cpu" -> the CPU."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + local_rank)
