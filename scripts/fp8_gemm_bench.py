"""torch._scaled_mm (FP8, row-wise scales, through mambaserve's scaled_mm path: Triton activation
quantization + cuBLASLt), the few-rows FP8 kernel (`ops/triton/fp8_gemv.py`, at M <= 64 with its
tuning max_m raised for the run; as `fp8_linear` calls it: rows quantized by their own launch
first, and with the quantization inside the kernel) and the bf16 product the engine runs
(`ops.linear`: the few-rows Triton kernel up to 8 rows, cuBLAS above) at the 9B preset's
quantized projections, M = 1, 8, 16, 64, 2048 tokens. CUDA graphs replay each op so launch
overhead is what the engine pays, and each call takes its own copy of the weight (the copies
together exceed the L2 cache, so every call reads HBM as in a decode step). Weight bandwidth
(bytes of the weight / time) is reported against the device-to-device copy ceiling
(`bench/roofline.copy_ceiling`). Prints a table and writes JSON.

    python scripts/fp8_gemm_bench.py --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.bench.roofline import copy_ceiling
from mambaserve.ops.fp8_matmul import (
    _fp8_linear_gemv,
    _fp8_linear_scaled_mm,
    quantize_fp8,
    quantize_weight_fp8,
)
from mambaserve.ops.linear import linear
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.fp8_gemv import launch_plan

GEMV_MAX_M = 64  # the few-rows kernel is timed up to this M (tuning max_m raised for the run)
L2_BYTES = 256 << 20  # weight copies per shape until their FP8 bytes exceed this

# (name, K, N) of the 9B preset's FP8 projections
SHAPES = [("mamba in_proj", 4480, 22656), ("mamba out_proj", 10240, 4480),
          ("mlp up_proj", 4480, 15680), ("mlp down_proj", 15680, 4480)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,16,64,2048")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    ceiling = copy_ceiling(torch.device("cuda"))["bytes_per_s"]
    rows = []
    for name, K, N in SHAPES:
        copies = max(1, min(16, -(-L2_BYTES // (N * K))))  # FP8 bytes per copy: N * K
        bf = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        fp = [quantize_weight_fp8(w) for w in bf]
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_fp8(x)
            t_bf16 = graph_time_us(fns=[lambda w=w: linear(x, w) for w in bf])
            t_fp8 = graph_time_us(fns=[lambda wq=wq, ws=ws: _fp8_linear_scaled_mm(
                x, wq, ws, None, None) for wq, ws in fp])
            t_mm = graph_time_us(fns=[lambda wq=wq, ws=ws: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
                for wq, ws in fp])
            t_q = graph_time_us(lambda x=x: quantize_fp8(x))
            row = {"op": name, "M": M, "K": K, "N": N, "bf16_us": t_bf16,
                   "fp8_linear_us": t_fp8, "scaled_mm_us": t_mm, "act_quant_us": t_q,
                   "speedup": t_bf16 / t_fp8, "fp8_weight_GBps": N * K / t_fp8 / 1e3,
                   "bf16_weight_GBps": 2 * N * K / t_bf16 / 1e3, "gemv_us": None,
                   "gemv_weight_GBps": None, "gemv_speedup": None, "gemv_plan": None}
            if M <= GEMV_MAX_M:
                try:  # a kernel that fails to compile leaves the other columns measured
                    with tuning.override("fp8_gemv", max_m=GEMV_MAX_M):
                        t_g = graph_time_us(fns=[lambda wq=wq, ws=ws: _fp8_linear_gemv(
                            x, wq, ws, None, None) for wq, ws in fp])
                        with tuning.override("fp8_gemv", prequant=False):
                            t_in = graph_time_us(fns=[lambda wq=wq, ws=ws: _fp8_linear_gemv(
                                x, wq, ws, None, None) for wq, ws in fp])
                        plan = launch_plan(M, N, K, x.device)
                    row.update(gemv_us=t_g, gemv_weight_GBps=N * K / t_g / 1e3,
                               gemv_speedup=t_bf16 / t_g, gemv_plan=plan,
                               gemv_inkernel_quant_us=t_in)
                except Exception as e:  # noqa: BLE001
                    row["gemv_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    print(f"fp8_gemv at {name} M={M}: {row['gemv_error']}")
            rows.append(row)
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s (read + write)")
    print("| op | M | bf16 us | scaled_mm path us (quant + scaled_mm) | scaled_mm us | quant us | "
          "fp8_gemv us (quant launch + kernel / quant inside) | bf16 / scaled_mm path | "
          "bf16 / fp8_gemv | weight GB/s bf16 / scaled_mm path / fp8_gemv (% of copy) |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def pct(v):
        return "-" if v is None else f"{v:.0f} ({100 * v * 1e9 / ceiling:.0f} %)"

    for r in rows:
        g = "-" if r["gemv_us"] is None else \
            f"{r['gemv_us']:.1f} / {r['gemv_inkernel_quant_us']:.1f}"
        gs = "-" if r["gemv_speedup"] is None else f"{r['gemv_speedup']:.2f}"
        print(f"| {r['op']} | {r['M']} | {r['bf16_us']:.1f} | {r['fp8_linear_us']:.1f} | "
              f"{r['scaled_mm_us']:.1f} | {r['act_quant_us']:.1f} | {g} | {r['speedup']:.2f} | "
              f"{gs} | {pct(r['bf16_weight_GBps'])} / {pct(r['fp8_weight_GBps'])} / "
              f"{pct(r['gemv_weight_GBps'])} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_ceiling_bytes_per_s": ceiling, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
