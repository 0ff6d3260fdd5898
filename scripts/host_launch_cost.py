"""Host time per call of the launch kinds an eager forward is made of: what a host-bound eager
step (docs/benchmarks.md, run 14: Granite-micro's 2048-token step ~40 ms of launches for ~23 ms
of device time) spends per kernel, split by who spends it.

    python3 scripts/host_launch_cost.py --out host_launch_cost.json   # needs a CUDA device

Each case runs `--calls` times back to back (few enough that the launch queue never fills, so
no call waits for the device), timed on the host only; the figure is the median over `--repeats`
such loops, in µs per call. Cases: an allocation, a torch elementwise op, cuBLAS linears (at
the few-token and the prefill shape, under each BLAS library torch offers), the dispatch
decision (`kernel_path`), and one Triton kernel (RMSNorm) through its public op and through
its Triton launcher directly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def per_call_us(fn, calls: int, repeats: int, device: torch.device) -> float:
    fn()  # compile / warm caches outside the timing
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=9, help="timed loops per case")
    p.add_argument("--tokens", type=int, default=2048, help="rows of the prefill-shaped cases")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_launch_cost.py needs a CUDA device")
    from mambaserve.ops.dispatch import kernel_path
    from mambaserve.ops.rmsnorm import rms_norm
    from mambaserve.ops.triton._common import pdl_launch
    from mambaserve.ops.triton.rmsnorm import _rms_norm_kernel, rms_norm_triton

    dev, bf = torch.device("cuda"), torch.bfloat16
    T, K, N = a.tokens, 2048, 8512  # Granite-micro's hidden size and Mamba in_proj
    x, x1 = torch.randn(T, K, device=dev, dtype=bf), torch.randn(16, K, device=dev, dtype=bf)
    w = torch.randn(N, K, device=dev, dtype=bf) * 0.02
    nw = torch.ones(K, device=dev, dtype=bf)
    out = torch.empty_like(x)
    pdl = pdl_launch(dev, _rms_norm_kernel)

    def raw_rms_norm():  # the launcher's one kernel call alone: no allocation, no lookups
        _rms_norm_kernel[(T,)](x, x, nw, out, x, x, K, 1e-5, x.stride(0), x.stride(1),
                               x.stride(0), x.stride(1), nw.stride(0), out.stride(0),
                               x.stride(0), HAS_RESIDUAL=False, ADD_NATIVE=False, QUANT=False,
                               HW_FP8=True, BLOCK_D=K, num_warps=4, **pdl)
    cases = {
        "torch.empty [T, N]": lambda: torch.empty(T, N, device=dev, dtype=bf),
        "torch add [T, K]": lambda: x + x,
        "kernel_path('rms_norm')": lambda: kernel_path("rms_norm", dev),
        "rms_norm (public op) [T, K]": lambda: rms_norm(x, nw, 1e-5),
        "rms_norm_triton (launcher) [T, K]": lambda: rms_norm_triton(x, nw, 1e-5),
        "_rms_norm_kernel[grid] (Triton's launch) [T, K]": raw_rms_norm,
    }
    rows = []
    for name, fn in cases.items():
        rows.append({"case": name, "us_per_call": per_call_us(fn, a.calls, a.repeats, dev)})
    default_blas = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:  # noqa: BLE001 - a build without it: say so and go on
            rows.append({"case": f"F.linear ({lib})", "error": f"{type(e).__name__}: {e}"})
            continue
        for label, inp, calls in (("16 rows", x1, a.calls), (f"{T} rows", x, 50)):
            rows.append({"case": f"F.linear {label} x [{N}, {K}] ({lib})",
                         "us_per_call": per_call_us(lambda i=inp: F.linear(i, w), calls,
                                                    a.repeats, dev)})
    torch.backends.cuda.preferred_blas_library(default_blas)
    env = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "default_blas": str(default_blas)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(env))
    for r in rows:
        print(f"{r['case']:<48} " + (f"{r['us_per_call']:8.2f} us/call" if "us_per_call" in r
                                     else r["error"]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
