"""Does warming a projection's weight into L2 while small kernels run make the decode GEMV that
follows it faster? (docs/kernels.md, "Known limits and untried ideas": batch-1 decode of the
narrow presets spends its time in launches of a few MB that do not reach the copy ceiling, while
the DRAM idles under the conv / state-update / norm kernels between them.)

Per shape, a CUDA graph replays, over distinct weight copies (together beyond L2, so each call
starts cold as in a decode step), µs per iteration:
- `plain`:    busy(T) -> gemv(W_i)
- `prefetch`: prefetch(W_i) -> busy(T) -> gemv(W_i)   (a launch of L2 prefetch instructions,
              fire-and-forget: it ends once they are issued)
- `hot`:      gemv(W_i) -> busy(T) -> gemv(W_i), minus one cold gemv: the L2-resident bound
- `busy`:     busy(T) alone, and `pf`: the prefetch launch alone
busy(T) stands for the small kernels between two projections: a compute-only launch of 64
programs (no DRAM traffic) tuned to ~T µs. The prefetch is `cp.async.bulk.prefetch.L2` (sm_90)
or `prefetch.global.L2::evict_last` per 128-byte line (`--mode line`).

    python scripts/l2_prefetch_probe.py --out l2_prefetch.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.ops.linear import linear

# (name, K, N): the narrow presets' decode projections (Granite-micro, Falcon-H1-7B) and the 9B's
SHAPES = [("granite out_proj", 4096, 2048), ("granite in_proj", 2048, 8512),
          ("granite down", 8192, 2048), ("falcon out_proj", 3072, 3072),
          ("9b out_proj", 10240, 4480)]
L2_BYTES = 200 << 20  # weight copies per shape until they exceed this


@triton.jit
def _busy_kernel(out_ptr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([128], tl.float32) + pid
    for _ in range(ITERS):
        acc = acc * 0.999 + 0.5
    tl.store(out_ptr + pid * 128 + tl.arange(0, 128), acc)


@triton.jit
def _prefetch_bulk_kernel(ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # one thread per CHUNK bytes (CHUNK a multiple of 16; the last chunk clipped to 16 bytes)
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    size = tl.where(offs < nbytes, size, 0)
    r = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2;"
        " mov.b32 $0, 0; }",
        "=r,l,r", [ptr + offs, size], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(ptr + offs, r.to(tl.int8), mask=r != 0)  # never: keeps the asm


@triton.jit
def _prefetch_line_kernel(ptr, nbytes, LINES: tl.constexpr, BLOCK: tl.constexpr):
    # each thread LINES consecutive 128-byte lines
    base = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * (LINES * 128)
    for j in range(LINES):
        offs = base + j * 128
        r = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2::evict_last [$1];"
            " mov.b32 $0, 0; }",
            "=r,l,l,l", [ptr + offs, offs, nbytes + offs * 0], dtype=tl.int32, is_pure=False,
            pack=1)
        tl.store(ptr + offs, r.to(tl.int8), mask=r != 0)


def prefetch(w: torch.Tensor, mode: str, chunk: int) -> None:
    nbytes = w.numel() * w.element_size()
    ptr = w.view(torch.int8)
    if mode == "bulk":
        n = triton.cdiv(nbytes, chunk)
        _prefetch_bulk_kernel[(triton.cdiv(n, 128),)](ptr, nbytes, CHUNK=chunk, BLOCK=128,
                                                       num_warps=4)
    else:
        lines = max(1, chunk // 128)
        n = triton.cdiv(nbytes, 128 * lines)
        _prefetch_line_kernel[(triton.cdiv(n, 128),)](ptr, nbytes, LINES=lines, BLOCK=128,
                                                       num_warps=4)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy-iters", default="0,2000,4000,8000")
    ap.add_argument("--mode", default="bulk,line")
    ap.add_argument("--chunk", type=int, default=4096, help="bytes per prefetching thread")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    sink = torch.empty(64 * 128, device=dev)
    rows = []
    for it in [int(v) for v in a.busy_iters.split(",")]:
        busy = (lambda it=it: _busy_kernel[(64,)](sink, ITERS=it, num_warps=4)) if it else None
        busy_us = graph_time_us(busy) if busy else 0.0
        for name, K, N in SHAPES:
            nb = K * N * 2
            copies = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
                      for _ in range(max(2, -(-L2_BYTES // nb)))]
            x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)

            def seq(w, pre=None, hot=False):
                def f():
                    if pre is not None:
                        prefetch(w, *pre)
                    if hot:
                        linear(x, w)
                    if busy:
                        busy()
                    linear(x, w)
                return f

            cold = graph_time_us(fns=[seq(w) for w in copies])
            row = {"shape": name, "K": K, "N": N, "MB": nb / 1e6, "busy_iters": it,
                   "busy_us": busy_us, "plain_us": cold}
            gemv_alone = graph_time_us(fns=[lambda w=w: linear(x, w) for w in copies])
            row["gemv_cold_us"] = gemv_alone
            row["hot_us"] = graph_time_us(fns=[seq(w, hot=True) for w in copies]) - gemv_alone
            for mode in a.mode.split(","):
                row[f"pf_{mode}_alone_us"] = graph_time_us(
                    fns=[lambda w=w, m=mode: prefetch(w, m, a.chunk) for w in copies])
                row[f"prefetch_{mode}_us"] = graph_time_us(
                    fns=[seq(w, pre=(mode, a.chunk)) for w in copies])
            rows.append(row)
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items()), flush=True)
            del copies
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
