"""Decode attention (the per-token paged kernel) at the families' attention shapes: device time of
one call for each (block_n, min_split_keys) pair of its tuning entry, T decode tokens of C keys
each, checked against the torch reference; timed through a CUDA graph (the split and combine
launches as a decode step pays them). Prints a table and the best pair per shape.

    python scripts/decode_attention_sweep.py --out decode_attention.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json

import torch

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.ops.paged_attention import paged_attention_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.paged_attention import decode_block_n, paged_attention_triton

# (name, query heads, KV heads, head_dim) of the presets' attention layers
SHAPES = [("nemotron-nano-9b-v2", 40, 8, 128), ("falcon-h1-7b", 12, 2, 128),
          ("granite-4.0-h-micro", 32, 8, 64)]
PAGE = 16


def case(T: int, C: int, H: int, Hkv: int, Dh: int, dtype=torch.bfloat16, device="cuda"):
    """T decode tokens at position C - 1 each, their pages scattered over the pool."""
    g = torch.Generator().manual_seed(0)
    pages_per = -(-C // PAGE)
    n = T * pages_per + 1
    kv = torch.randn(2, n, PAGE, Hkv, Dh, generator=g).to(dtype).to(device)
    table = torch.randperm(n - 1, generator=g)[: T * pages_per].view(T, pages_per).to(device)
    q = torch.randn(T, H, Dh, generator=g).to(dtype).to(device)
    rows = torch.arange(T, device=device)
    pos = torch.full((T,), C - 1, dtype=torch.int64, device=device)
    return q, kv, table, rows, pos


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64")
    ap.add_argument("--context", default="512,2048,8192")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--min-split", default="16,32,64,128,256")
    ap.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (a check)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    rows, best = [], {}
    print("| shape | T | context | block_n | min_split_keys | us | max err |")
    print("|---|---|---|---|---|---|---|")
    for name, H, Hkv, Dh in SHAPES:
        for T in ints(a.tokens):
            for C in ints(a.context):
                dtype = torch.bfloat16 if a.device != "cpu" else torch.float32
                q, kv, table, r, pos = case(T, C, H, Hkv, Dh, dtype, a.device)
                scale = Dh ** -0.5
                ref = paged_attention_ref(q.float(), kv.float(), table, r, pos, C, scale)
                for bn in ints(a.block_n):
                    for ms in ints(a.min_split):
                        with tuning.override("paged_attention", block_n=bn, min_split_keys=ms):
                            fn = lambda: paged_attention_triton(q, kv, table, r, pos, C, scale)  # noqa: E731,B023
                            err = (fn().float() - ref).abs().max().item()
                            us = (graph_time_us(fn)
                                  if a.device != "cpu" else float("nan"))  # CPU: a check only
                        rows.append(dict(shape=name, T=T, context=C, block_n=bn,
                                         min_split_keys=ms, us=us, max_err=err))
                        print(f"| {name} | {T} | {C} | {bn} | {ms} | {us:.1f} | {err:.1e} |")
                        k = (name, T, C)
                        if k not in best or us < best[k][0]:
                            best[k] = (us, bn, ms)
    print("\nbest (block_n, min_split_keys) per shape; the current defaults' time beside it:")
    cur = tuning.config("paged_attention", torch.device(a.device))
    dh = {name: Dh for name, _, _, Dh in SHAPES}
    for (name, T, C), (us, bn, ms) in best.items():
        now = next((x["us"] for x in rows if (x["shape"], x["T"], x["context"]) == (name, T, C)
                    and x["block_n"] == (cur["block_n"] or decode_block_n(dh[name]))
                    and x["min_split_keys"] == cur["min_split_keys"]), float("nan"))
        print(f"{name} T={T} C={C}: {us:.1f} us at ({bn}, {ms}); defaults {now:.1f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
