"""Mamba state pool: conv + SSM state of every Mamba layer, one slot per live request (or cached
prefix-snapshot), allocated and freed on the host.

Invariants
| what                     | rule                                                            |
|--------------------------|-----------------------------------------------------------------|
| slot ids                 | 0 .. num_slots-1 are allocatable; index num_slots is scratch     |
| scratch slot             | target of negative (padding) slots; never allocated, never read  |
|                          | as a real state                                                 |
| a free slot's contents   | garbage; a new request starts with has_initial_state = False    |
| restore / snapshot       | written inside the forward (ops/state_snapshot.py)              |
"""

from __future__ import annotations

import torch

from mambaserve.config import ModelConfig


class StatePool:
    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device | str) -> None:
        if num_slots < 1:
            raise ValueError("the state pool needs at least one slot")
        L = len(cfg.mamba_layer_ids)
        self.num_slots = num_slots
        self.conv_state = torch.zeros(L, num_slots + 1, cfg.conv_kernel - 1, cfg.conv_dim,
                                      dtype=dtype, device=device)
        self.ssm_state = torch.zeros(L, num_slots + 1, cfg.mamba_num_heads, cfg.mamba_head_dim,
                                     cfg.ssm_state_size, dtype=ssm_dtype, device=device)
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        L = len(cfg.mamba_layer_ids)
        conv = (cfg.conv_kernel - 1) * cfg.conv_dim * dtype.itemsize
        ssm = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.ssm_state_size * ssm_dtype.itemsize
        return L * (conv + ssm)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return (self.conv_state.numel() * self.conv_state.element_size()
                + self.ssm_state.numel() * self.ssm_state.element_size())

    @property
    def bytes_per_slot_actual(self) -> int:
        return self.nbytes // (self.num_slots + 1)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise RuntimeError(f"freeing slot {slot} that is not allocated")
        self._free.append(slot)
