"""The paged KV pool's host bookkeeping: which pages an allocation hands out, and their counts."""

from types import SimpleNamespace

import torch

from mambaserve.cache.kv_pool import KVPool


def pool(num_pages: int) -> KVPool:
    cfg = SimpleNamespace(attention_layer_ids=[1], num_kv_heads=1, head_dim=2)
    return KVPool(cfg, num_pages, page_size=4, dtype=torch.float32, device="cpu")


def test_allocate_hands_out_the_lowest_free_pages_in_order_and_counts_them():
    kv = pool(6)
    assert kv.allocate(0) == [] and kv.num_free == 6
    assert kv.allocate(2) == [0, 1] and kv.allocate(3) == [2, 3, 4]
    assert kv.ref_count == [1, 1, 1, 1, 1, 0] and kv.num_free == 1
    assert kv.allocate(2) is None and kv.num_free == 1  # too few: nothing taken
    kv.release([3, 1])
    # released pages come back last-released first, as a stack of single pops would give
    assert kv.allocate(3) == [1, 3, 5] and kv.num_free == 0 and kv.ref_count == [1] * 6
