"""The closing projections' GEMMs of the Nemotron-Nano-9B-v2 preset (out_proj, the MLP's down,
attention's o_proj: N = 4,480 outputs, residual added in cuBLAS's epilogue as `linear_residual`
does) at a few token counts: one `addmm_` against two into column halves, at each split point
in steps of 128 columns, and the split `ops/gemm_waves.py`'s rule picks (GPU machine, repo
root):

    python3 scripts/gemm_waves_sweep.py 1024,2048,4096

Per shape: the one GEMM's time and rate, each split's, the best, the rule's choice at
split_tail 0.34 with tiles of 128 and of 256 columns, and the cuBLAS kernels of both
(docs/kernels.md, "Closing projections in two GEMMs").
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.ops.gemm_waves import split_columns

HIDDEN = 4480
K_OF = {"out_proj": 10240, "down": 15680, "o_proj": 5120}


def _time_us(fn) -> float:
    """µs per call, replayed from a CUDA graph as the engine's prefill graphs run it."""
    return graph_time_us(fn, calls_per_graph=4, iters=5)


def _kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.key[:100] for e in prof.key_averages() if e.device_type.name == "CUDA"]


def _gemms(x, w, out, n1: int):
    """out += x wᵀ as one addmm_ (n1 0) or two into the column halves at n1."""
    if not n1:
        return lambda: out.addmm_(x, w.t())

    def two():
        out[:, :n1].addmm_(x, w[:n1].t())
        out[:, n1:].addmm_(x, w[n1:].t())
    return two


def main(token_counts: list[int]) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs")
    for M in token_counts:
        for name, K in K_OF.items():
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            w = torch.randn(HIDDEN, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
            out = torch.zeros(M, HIDDEN, device=dev, dtype=torch.bfloat16)
            flop = 2 * M * HIDDEN * K
            one = _time_us(_gemms(x, w, out, 0))
            times = {n1: _time_us(_gemms(x, w, out, n1)) for n1 in range(HIDDEN - 128, 3000, -128)}
            best = min(times, key=times.get)
            rule = {tn: split_columns(M, HIDDEN, sms, 0.34, 128, tn) for tn in (128, 256)}
            print(f"M={M} {name} (K={K}): one GEMM {one:.1f} µs ({flop / one / 1e6:.0f} TFLOP/s); "
                  f"best split {best} + {HIDDEN - best}: {times[best]:.1f} µs "
                  f"({flop / times[best] / 1e6:.0f}); rule (tiles of 128 / 256 columns): "
                  + ", ".join(f"{n1 or 'none'} {times.get(n1, one):.1f} µs"
                              for n1 in rule.values()))
            print("  splits: " + " ".join(f"{n1}:{t:.0f}" for n1, t in times.items()))
            print(f"  kernels of one: {_kernels(_gemms(x, w, out, 0))}")
            print(f"  kernels of the best split: {_kernels(_gemms(x, w, out, best))}")


if __name__ == "__main__":
    main([int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "2048").split(",")])
