"""Paged KV pool for the attention layers: fixed-size pages handed out on the host.

Invariants
| what            | rule                                                                   |
|-----------------|------------------------------------------------------------------------|
| page ids        | 0 .. num_pages-1 allocatable; index num_pages is scratch (padding)     |
| reference count | a page is free iff its count is 0; shared prefix pages count each user |
| contents        | zero-initialized so masked reads of unwritten pages are never NaN      |
"""

from __future__ import annotations

import torch

from mambaserve.config import ModelConfig


class KVPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        L = len(cfg.attention_layer_ids)
        self.num_pages, self.page_size = num_pages, page_size
        self.kv_cache = torch.zeros(L, 2, num_pages + 1, page_size, cfg.num_kv_heads,
                                    cfg.head_dim, dtype=dtype, device=device)
        self.ref_count = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        L = len(cfg.attention_layer_ids)
        return L * 2 * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        # the last n free pages, last first (the order n pops would give), in two list ops
        cut = len(self._free) - n
        pages = self._free[cut:][::-1]
        del self._free[cut:]
        for p in pages:
            self.ref_count[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref_count[p] <= 0:
                raise RuntimeError(f"retaining free page {p}")
            self.ref_count[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.ref_count[p] <= 0:
                raise RuntimeError(f"releasing free page {p}")
            self.ref_count[p] -= 1
            if self.ref_count[p] == 0:
                self._free.append(p)
