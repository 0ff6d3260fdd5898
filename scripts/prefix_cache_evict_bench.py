"""Host time of the prefix cache's eviction with a large tree (no GPU needed):

    python scripts/prefix_cache_evict_bench.py --conversations 500 --blocks 16

Builds a tree of conversations x blocks nodes (every conversation a path of `blocks` blocks of
128 tokens with a snapshot at its end, as multi-turn serving leaves it), then times
`evict(slots=free + 1)` (a full state pool handing out one snapshot slot: the engine step pays
this) and one eviction of 16 blocks' worth of KV pages (an admission of 2,048 new tokens)."""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch

from mambaserve.bench.presets import preset_config, write_config
from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.radix_cache import PrefixCache
from mambaserve.cache.state_pool import StatePool
from mambaserve.config import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=500)
    p.add_argument("--blocks", type=int, default=16, help="blocks per conversation")
    p.add_argument("--evictions", type=int, default=50)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ModelConfig.from_hf(write_config(preset_config("tiny"), tmp))
    interval, page = 128, 16
    pages_per_conv = a.blocks * interval // page
    sp = StatePool(cfg, a.conversations + 8, torch.float32, torch.float32, "cpu")
    kv = KVPool(cfg, a.conversations * pages_per_conv + 64, page, torch.float32, "cpu")
    cache = PrefixCache(interval, sp, kv)
    rng = random.Random(0)
    for _ in range(a.conversations):
        tokens = [rng.randrange(50_000) for _ in range(interval * a.blocks)]
        pages = kv.allocate(pages_per_conv)
        cache.insert(tokens, pages, sp.allocate())
        kv.release(pages)
    print(f"{len(cache.nodes())} nodes, {cache.num_snapshots} snapshots")
    t = time.perf_counter()
    for _ in range(a.evictions):
        cache.evict(slots=sp.num_free + 1)
    print(f"evict(slots=free + 1): {(time.perf_counter() - t) / a.evictions * 1e6:.0f} us per call")
    t = time.perf_counter()
    cache.evict(pages=kv.num_free + 16 * interval // page)
    print(f"evict 16 blocks of pages: {(time.perf_counter() - t) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
