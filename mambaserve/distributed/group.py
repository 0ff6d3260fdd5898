"""The tensor-parallel process group: this process's rank and the group size, and the two
collectives tensor parallelism needs (all-reduce of partial sums, all-gather of vocab shards).
At tp_size 1 both are no-ops, so a model sharded for one rank runs exactly the unsharded path."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    tp_rank: int
    tp_size: int
    group: dist.ProcessGroup | None = None  # None: the default (world) group

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not in [0, tp_size {self.tp_size})")

    @classmethod
    def single(cls) -> TPGroup:
        """One rank, no process group: every collective is the identity."""
        return cls(0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place; returns `x`."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x` (same shape and dtype), in place; returns it."""
        if self.tp_size > 1:
            dist.broadcast(x, src, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


def init_tp(rank: int, world_size: int, init_method: str, backend: str = "gloo",
            timeout_s: float = 60.0) -> TPGroup:
    """Join the process group (`init_method`: "tcp://host:port", "file:///path", "env://") as
    `rank` of `world_size`, every rank in one tensor-parallel group. A collective that waits
    longer than `timeout_s` for a peer raises instead of hanging."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size {world_size})")
    if world_size == 1:
        return TPGroup.single()
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return TPGroup(rank, world_size)


def destroy_tp() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
