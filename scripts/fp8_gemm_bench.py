"""torch._scaled_mm (FP8, row-wise scales, through mambaserve's fp8_linear: Triton activation
quantization + cuBLASLt) vs a bf16 matmul at the 9B preset's quantized projections, M = 1, 64,
2048 tokens; CUDA graphs replay each op so launch overhead is what the engine pays. Prints a
table and writes JSON.

    python scripts/fp8_gemm_bench.py --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mambaserve.ops.fp8_matmul import fp8_linear, quantize_fp8, quantize_weight_fp8

# (name, K, N) of the 9B preset's FP8 projections
SHAPES = [("mamba in_proj", 4480, 22656), ("mamba out_proj", 10240, 4480),
          ("mlp up_proj", 4480, 15680), ("mlp down_proj", 15680, 4480)]


def graph_time_us(fn, iters: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (iters * 10))
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,64,2048")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = []
    for name, K, N in SHAPES:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight_fp8(w)
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_fp8(x)
            t_bf16 = graph_time_us(lambda x=x, w=w: x @ w.t())
            t_fp8 = graph_time_us(lambda x=x, wq=wq, ws=ws: fp8_linear(x, wq, ws))
            t_mm = graph_time_us(lambda xq=xq, xs=xs, wq=wq, ws=ws: torch._scaled_mm(
                xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16))
            t_q = graph_time_us(lambda x=x: quantize_fp8(x))
            rows.append(dict(op=name, M=M, K=K, N=N, bf16_us=t_bf16, fp8_linear_us=t_fp8,
                             scaled_mm_us=t_mm, act_quant_us=t_q,
                             speedup=t_bf16 / t_fp8,
                             fp8_weight_GBps=N * K / t_fp8 / 1e3,
                             bf16_weight_GBps=2 * N * K / t_bf16 / 1e3))
    print("| op | M | bf16 us | fp8_linear us (quant + scaled_mm) | scaled_mm us | quant us | "
          "speedup | fp8 weight GB/s | bf16 weight GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['M']} | {r['bf16_us']:.1f} | {r['fp8_linear_us']:.1f} | "
              f"{r['scaled_mm_us']:.1f} | {r['act_quant_us']:.1f} | {r['speedup']:.2f} | "
              f"{r['fp8_weight_GBps']:.0f} | {r['bf16_weight_GBps']:.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
