"""The tiled paged-attention kernel (`ops/triton/paged_attention.py`, what prefill tokens use) on
prefill shapes with and without a cached prefix, at the 9B preset's attention (40 query heads, 8
KV heads, head_dim 128, page size 16, bf16): rows x (P cached keys, T new tokens per row), each
row's pages shuffled in the pool. Per shape: torch SDPA over the row's contiguous keys without a
mask (a speed reference, not the same math), the launcher's default (key partitions from
`tiled_num_splits` with max_kv_len = the real length and = 131,072, as a CUDA graph captures
it), then every candidate tile (block_m, block_n, num_warps) x key partitions; each checked
against the default's output. Device time by `triton.testing.do_bench`.

    python scripts/prefix_attention_sweep.py              # on a GPU
"""

from __future__ import annotations

import argparse
import itertools

import torch
from triton.testing import do_bench

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.paged_attention import paged_attention_triton

H, HKV, D, PAGE = 40, 8, 128, 16
SHAPES = [(1, 0, 32), (1, 0, 128), (1, 0, 255), (1, 2048, 32), (1, 2048, 128), (1, 2048, 512),
          (1, 8192, 128), (1, 2048, 2048), (1, 8192, 2048), (4, 2048, 128), (8, 0, 64)]
TILES = [(128, 16, 4), (128, 32, 8), (128, 64, 8), (64, 32, 4), (64, 64, 4)]
SPLITS = [1, 2, 4, 8]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--top", type=int, default=4, help="best candidates printed per shape")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print("| rows x (P + T) | SDPA us | default us (max_kv_len n / 131072) | best candidates: "
          "block_m / block_n / warps / partitions us |")
    print("|---|---|---|---|")
    for R, P, T in SHAPES:
        n = P + T
        per_row = -(-n // PAGE)
        g = torch.Generator(device=dev).manual_seed(0)
        kv = torch.randn(2, R * per_row + 1, PAGE, HKV, D, device=dev, dtype=dt, generator=g)
        perm = torch.randperm(R * per_row, device=dev, generator=g)
        pt = perm.view(R, per_row).to(torch.int64)
        q = torch.randn(R * T, H, D, device=dev, dtype=dt, generator=g)
        row = torch.arange(R, device=dev).repeat_interleave(T)
        pos = torch.arange(P, P + T, device=dev).repeat(R)

        def run(mkl: int) -> torch.Tensor:
            return paged_attention_triton(q, kv, pt, row, pos, mkl, D ** -0.5, tiled=True)

        keys = [kv[i][perm].reshape(R, per_row * PAGE, HKV, D)[:, :n].transpose(1, 2)
                for i in (0, 1)]
        qd = q.view(R, T, H, D).transpose(1, 2)
        sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, *keys, scale=D ** -0.5, enable_gqa=True), warmup=10, rep=60) * 1e3
        ref = run(n).float()
        default = [do_bench(lambda m=m: run(m), warmup=10, rep=60) * 1e3 for m in (n, 131072)]
        res = []
        for (bm, bn, nw), ns in itertools.product(TILES, SPLITS):
            with tuning.override("paged_attention_tiled", block_m=bm, block_n=bn, num_warps=nw,
                                 num_splits=ns):
                err = ((run(n).float() - ref).abs().max() / ref.abs().max()).item()
                us = do_bench(lambda: run(n), warmup=10, rep=60) * 1e3
            if err > 2e-2:
                print(f"   MISMATCH {bm}/{bn}/{nw}/{ns}: rel err {err:.1e}")
            res.append((us, f"{bm}/{bn}/{nw}/{ns}"))
        best = ", ".join(f"{c} {us:.1f}" for us, c in sorted(res)[:a.top])
        print(f"| {R} x ({P} + {T}) | {sdpa:.1f} | {default[0]:.1f} / {default[1]:.1f} | {best} |",
              flush=True)


if __name__ == "__main__":
    main()
