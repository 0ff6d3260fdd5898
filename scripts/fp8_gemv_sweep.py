"""The FP8 few-rows linear (`ops/triton/fp8_gemv.py`, on pre-quantized rows as the engine runs it)
over candidate launch settings, and the activation quantization passes that feed it
(`ops/triton/fp8_quant.py`, the RMSNorm that writes FP8 rows), at the 9B preset's FP8 projections,
M = 1, 8 and 64 token rows by default (the kernel's max_m raised to 128 for the run; the
`_scaled_mm` path that batches above max_m take beside it): device time per call through CUDA
graphs, each call on its own weight copy (the copies together exceed the L2 cache, as in a decode
step), weight bytes over time against the copy ceiling (`--candidates rows --m 16,32,64`:
tensor-core launches for a decode batch beside the bf16 product such a batch takes; `--candidates
rules`: the launch rules against the former ones). Each candidate is checked against the reference
math on the same quantized operands first. Prints tables and writes JSON.

    python scripts/fp8_gemv_sweep.py --out fp8_gemv_sweep.json          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.bench.roofline import copy_ceiling
from mambaserve.ops.activation import relu2
from mambaserve.ops.fp8_matmul import (
    Fp8Rows,
    _fp8_linear_scaled_mm,
    fp8_linear_ref,
    quantize_fp8,
    quantize_weight_fp8,
)
from mambaserve.ops.gated_rmsnorm import gated_rmsnorm
from mambaserve.ops.linear import linear
from mambaserve.ops.rmsnorm import rms_norm
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.fp8_gemv import fp8_gemv_triton, launch_plan

L2_BYTES = 256 << 20
# (name, K, N) of the 9B preset's FP8 projections
SHAPES = [("mamba in_proj", 4480, 22656), ("mamba out_proj", 10240, 4480),
          ("mlp up_proj", 4480, 15680), ("mlp down_proj", 15680, 4480)]

FMA = [  # CUDA-core launches (dot_min_m above M)
    {},  # the rules
    {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 1},
    {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 2},
    {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 4},
    {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 2},
    {"block_n": 8, "block_k": 1024, "num_warps": 8, "num_stages": 2},
    {"block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 3},
    {"block_n": 4, "block_k": 512, "num_warps": 2, "num_stages": 3},
    {"block_n": 4, "block_k": 2048, "num_warps": 8, "num_stages": 2},
    {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 3},
    {"block_n": 16, "block_k": 512, "num_warps": 8, "num_stages": 3},
    {"block_n": 16, "block_k": 1024, "num_warps": 8, "num_stages": 2},
    {"block_n": 2, "block_k": 2048, "num_warps": 4, "num_stages": 2},
    {"block_n": 8, "block_k": 256, "num_warps": 2, "num_stages": 4},
    {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3, "split_k": 2},
    {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 3, "fold": 4},
    {"block_n": 8, "block_k": 1024, "num_warps": 4, "num_stages": 3, "fold": 8},
    {"block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "fold": 4},
    {"block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "split_k": 2},
]
DOT = [  # tensor-core launches (M = 8)
    {"dot_min_m": 1},
    {"dot_min_m": 1, "block_n": 32, "block_k": 128, "num_stages": 4},
    {"dot_min_m": 1, "block_n": 32, "block_k": 256, "num_stages": 3},
    {"dot_min_m": 1, "block_n": 64, "block_k": 256, "num_stages": 3},
    {"dot_min_m": 1, "block_n": 128, "block_k": 128, "num_stages": 3, "num_warps": 8},
    {"dot_min_m": 1, "block_n": 16, "block_k": 256, "num_stages": 4},
    {"dot_min_m": 1, "block_n": 16, "block_k": 512, "num_stages": 3},
    {"dot_min_m": 1, "block_n": 64, "block_k": 256, "num_stages": 3, "split_k": 1},
    {"dot_min_m": 1, "block_n": 64, "block_k": 256, "num_stages": 3, "split_k": 2},
    {"dot_min_m": 1, "block_n": 32, "block_k": 256, "num_stages": 3, "split_k": 2},
    {"dot_min_m": 1, "block_n": 32, "block_k": 256, "num_stages": 4, "split_k": 4},
    {"dot_min_m": 99, "block_n": 4, "block_k": 128, "num_warps": 4, "num_stages": 3},
    {"dot_min_m": 99, "block_n": 2, "block_k": 256, "num_warps": 4, "num_stages": 3},
]
NATIVE = [  # native e4m3 wgmma instructions, each promoted to the float32 sum (promote_k 32)
    {"dot_min_m": 1, "promote_k": 32},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 64, "block_k": 512},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 64, "block_k": 256, "num_stages": 4},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 64, "block_k": 512, "num_stages": 4},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 128, "block_k": 256},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 128, "block_k": 256, "num_warps": 8},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 64, "block_k": 256, "split_k": 1},
    {"dot_min_m": 1, "promote_k": 32, "block_n": 64, "block_k": 256, "split_k": 2},
    {"dot_min_m": 1, "promote_k": 128, "block_n": 64, "block_k": 256},
]
ROWS = [  # tensor-core launches for a decode batch of 16-128 rows (`--candidates rows`)
    {"dot_min_m": 1},  # the launch rules
    {"dot_min_m": 1, "block_k": 256, "num_stages": 3, "split_waves": 2},  # the former rules
    {"dot_min_m": 1, "block_k": 128, "num_stages": 4, "split_waves": 1},
    {"dot_min_m": 1, "block_k": 128, "num_stages": 3, "split_waves": 1},
    {"dot_min_m": 1, "block_k": 128, "num_stages": 4, "split_waves": 4},
    {"dot_min_m": 1, "block_k": 256, "num_stages": 3, "split_waves": 1},
    {"dot_min_m": 1, "block_k": 256, "num_stages": 4, "split_waves": 1},
    {"dot_min_m": 1, "block_n": 32, "block_k": 256, "num_stages": 3, "split_waves": 2},
    {"dot_min_m": 1, "block_n": 32, "block_k": 256, "num_stages": 3, "split_waves": 1},
    {"dot_min_m": 1, "block_n": 32, "block_k": 128, "num_stages": 4, "split_waves": 1},
    {"dot_min_m": 1, "block_n": 128, "block_k": 128, "num_stages": 3, "num_warps": 8},
    {"dot_min_m": 1, "promote_k": 32, "block_k": 256, "num_stages": 3, "split_waves": 2},
]

RULES = [  # `--candidates rules`: the launch rules against the former tensor-core rules
    {"dot_min_m": 4},
    {"dot_min_m": 4, "block_k": 256, "num_stages": 3, "split_waves": 2},
]


def candidates(M: int, which: str = "all") -> list[dict]:
    """FMA launches and the tensor-core ones for one or two rows; tensor-core ones above; the
    native fp8 ones everywhere (`which` "native": the rules and those only; "rows": the
    tensor-core launches for batches of 16-128 rows; "rules": the launch rules and the former
    tensor-core rules)."""
    if which == "native":
        return [{}] + NATIVE
    if which == "rows":
        return ROWS
    if which == "rules":
        return RULES
    if M <= 2:
        return FMA + DOT[:5] + DOT[7:11] + NATIVE
    return (DOT if M <= 8 else DOT[:11]) + NATIVE  # no CUDA-core launch for many rows


def sweep_gemv(ceiling: float, ms: list[int], which: str = "all") -> list[dict]:
    rows = []
    for name, K, N in SHAPES:
        copies = max(1, min(16, -(-L2_BYTES // (N * K))))
        ws = [quantize_weight_fp8(torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            q, s = quantize_fp8(x)
            want = fp8_linear_ref(Fp8Rows(q, s, x.dtype), ws[0][0], ws[0][1]).float()
            rows_ = Fp8Rows(q, s, x.dtype)  # the path batches above max_m take today
            t_mm = graph_time_us(fns=[lambda w=w, sc=sc: _fp8_linear_scaled_mm(
                rows_, w, sc, None, None) for w, sc in ws])
            row = {"op": name, "M": M, "K": K, "N": N, "knobs": "scaled_mm", "us": t_mm,
                   "pct": 100 * N * K / (t_mm * 1e-6) / ceiling}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if which in ("rows", "rules"):  # the bf16 product this batch takes in bf16
                wb = [w.to(torch.bfloat16) * sc[:, None].to(torch.bfloat16) for w, sc in ws]
                t_bf = graph_time_us(fns=[lambda w=w: linear(x, w) for w in wb])
                row = {"op": name, "M": M, "K": K, "N": N, "knobs": "bf16", "us": t_bf,
                       "pct": 100 * 2 * N * K / (t_bf * 1e-6) / ceiling}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del wb
            for knobs in candidates(M, which):
                row = {"op": name, "M": M, "K": K, "N": N, "knobs": knobs}
                try:
                    with tuning.override("fp8_gemv", **{"dot_min_m": 99, "max_m": 128, **knobs}):
                        got = fp8_gemv_triton(q, ws[0][0], ws[0][1], x_scale=s,
                                              out_dtype=x.dtype).float()
                        err = ((got - want).abs() / (want.abs() + 1e-2)).max().item()
                        if not err < 2e-2:
                            raise AssertionError(f"max relative error {err:.3g}")
                        t = graph_time_us(fns=[lambda w=w, sc=sc: fp8_gemv_triton(
                            q, w, sc, x_scale=s, out_dtype=x.dtype) for w, sc in ws])
                        row["plan"] = launch_plan(M, N, K, x.device)
                    row.update(us=t, pct=100 * N * K / (t * 1e-6) / ceiling)
                except Exception as e:  # noqa: BLE001 -- a failing candidate is reported
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "plan"}), flush=True)
    return rows


def sweep_quant(ms: list[int]) -> list[dict]:
    rows = []
    for K in (4480, 10240, 15680):
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            w = torch.ones(K, device="cuda", dtype=torch.bfloat16)
            cases = {"relu2 then quant": lambda: quantize_fp8(relu2(x)),
                     "quant(act=relu2)": lambda: quantize_fp8(x, act="relu2")}
            for warps in (None, 4, 8, 16, 32):
                for tile in (16384, 1024):
                    cases[f"quant tile {tile} warps {warps}"] = (
                        lambda warps=warps, tile=tile: _with(
                            "fp8_quant", {"num_warps": warps, "max_tile": tile},
                            lambda: quantize_fp8(x)))
            if K == 4480:
                cases["rms_norm"] = lambda: rms_norm(x, w, 1e-5)
                cases["rms_norm quantize"] = lambda: rms_norm(x, w, 1e-5, quantize=True)
                cases["rms_norm then quant"] = lambda: quantize_fp8(rms_norm(x, w, 1e-5))
            if K == 10240:  # Mamba's gated norm (8 groups of 1280), then out_proj's rows
                z = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                wn = torch.ones(K, device="cuda", dtype=torch.bfloat16)
                cases["gated_rmsnorm"] = lambda: gated_rmsnorm(x, z, wn, 1280, 1e-5)
                cases["gated_rmsnorm then quant"] = lambda: quantize_fp8(
                    gated_rmsnorm(x, z, wn, 1280, 1e-5))
                cases["gated_rmsnorm quantize"] = lambda: gated_rmsnorm(
                    x, z, wn, 1280, 1e-5, quantize=True)
                for warps in (8, 16, 32):  # the whole-row launch
                    cases[f"gated_rmsnorm quantize whole row warps {warps}"] = (
                        lambda warps=warps: _with("gated_rmsnorm",
                                                  {"fp8_num_warps": warps, "fp8_unfused_rows": 0},
                                                  lambda: gated_rmsnorm(x, z, wn, 1280, 1e-5,
                                                                        quantize=True)))
            for what, fn in cases.items():
                row = {"K": K, "M": M, "case": what, "us": graph_time_us(fn)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def _with(kernel, knobs, fn):
    with tuning.override(kernel, **knobs):
        return fn()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,64")
    ap.add_argument("--only", choices=["gemv", "quant"], default=None)
    ap.add_argument("--candidates", choices=["all", "native", "rows", "rules"], default="all",
                    help="native: the launch rules and the native fp8 wgmma launches only; "
                         "rows: tensor-core launches for 16-128 rows, with the bf16 product; "
                         "rules: the launch rules against the former tensor-core rules")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ms = [int(m) for m in a.m.split(",")]
    ceiling = copy_ceiling(torch.device("cuda"))["bytes_per_s"]
    out = {"device": torch.cuda.get_device_name(), "copy_ceiling_bytes_per_s": ceiling}
    if a.only in (None, "quant"):
        out["quant"] = sweep_quant(ms)
    if a.only in (None, "gemv"):
        out["gemv"] = sweep_gemv(ceiling, ms, a.candidates)
        best: dict = {}
        for r in out["gemv"]:
            key = (r["op"], r["M"])
            if "us" in r and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        print("best per shape:")
        for (op, M), r in best.items():
            print(f"  {op} M={M}: {r['us']:.1f} us ({r['pct']:.0f} % of copy) {r['knobs']}")
        for M in ms:  # geometric mean over shapes of best / candidate
            for i, knobs in enumerate(candidates(M, a.candidates)):
                rs = [r for r in out["gemv"] if r["M"] == M and r["knobs"] == knobs and "us" in r]
                if len(rs) == len(SHAPES):
                    g = math.exp(sum(math.log(best[(r["op"], M)]["us"] / r["us"]) for r in rs)
                                 / len(rs))
                    print(f"  M={M} candidate {i} {knobs}: geomean best/it {g:.3f}, "
                          f"{sum(r['us'] for r in rs):.1f} us over the projections")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
