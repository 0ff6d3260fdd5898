"""What every case of `mambaserve bench kernels` shares: the shapes, the device and dtype, the
timer, the result rows, and the ceilings measured in the same run.

Real runs (CUDA): Nemotron-Nano-9B-v2 layer shapes in bf16; times are medians of CUDA-event
timings (`triton.testing.do_bench(return_mode="median")`, which flushes L2 before every call).
Dry runs (`--dry`): tiny shapes in fp16 on the CPU under the Triton interpreter (its bf16 dot is
wrong), each case called twice and timed once with a wall clock: a smoke test of the script, not
a measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shapes:
    """Mamba layer (heads, head dim, state, groups, conv width, chunk) and attention layer
    (query heads, KV heads, head dim, page size)."""

    H: int
    P: int
    N: int
    G: int
    K: int
    L: int
    attn_heads: int
    attn_kv_heads: int
    attn_head_dim: int
    page_size: int

    @property
    def d_inner(self) -> int:
        return self.H * self.P

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.G * self.N


# Nemotron-Nano-9B-v2 (conv_dim 12288) and the engine's page size
NEMOTRON_NANO_9B = Shapes(H=128, P=80, N=128, G=8, K=4, L=128, attn_heads=40, attn_kv_heads=8,
                          attn_head_dim=128, page_size=16)
DRY = Shapes(H=4, P=16, N=16, G=2, K=4, L=16, attn_heads=4, attn_kv_heads=2, attn_head_dim=16,
             page_size=4)


class Harness:
    """Shapes, device, dtype and timer of one run, and the rows it records."""

    def __init__(self, dry: bool) -> None:
        self.dry = dry
        self.shapes = DRY if dry else NEMOTRON_NANO_9B
        self.device = "cpu" if dry else "cuda"
        self.dtype = torch.float16 if dry else torch.bfloat16
        self.results: dict = {"rows": []}

    def time_ms(self, fn, rep: int = 60) -> float:
        """Median milliseconds of fn() (dry: one wall-clock call after a first one)."""
        if self.dry:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return do_bench(fn, warmup=15, rep=rep, return_mode="median")

    def device_us(self, fn) -> float:
        """Device microseconds of fn() replayed from a CUDA graph, the gaps between its
        launches included, the host's launch cost not (`graph_time_us`); NaN on a dry run. For
        shapes so small that `time_ms`, which launches from the host, times the host."""
        if self.dry:
            return float("nan")
        from mambaserve.bench.graph_timing import graph_time_us

        return graph_time_us(fn, calls_per_graph=5, iters=10, rounds=3)

    def row(self, **fields) -> None:
        """Record one measurement and print it on one line."""
        self.results["rows"].append(fields)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in fields.items()), flush=True)

    def ceilings(self) -> None:
        """Device-to-device copy bandwidth (bytes read + written) and a bf16 8192³ matmul rate,
        timed like the kernels."""
        n = 1 << 30  # 1 GiB copied: 2 GiB moved
        a = torch.empty(n, dtype=torch.uint8, device=self.device).random_(0, 255)
        b = torch.empty_like(a)
        ms = self.time_ms(lambda: b.copy_(a))
        self.results["copy_TBps"] = 2 * n / ms / 1e9
        del a, b
        m = torch.randn(8192, 8192, device=self.device, dtype=self.dtype)
        m2 = torch.randn(8192, 8192, device=self.device, dtype=self.dtype)
        ms = self.time_ms(lambda: m @ m2)
        self.results["bf16_mm_TFLOPs"] = 2 * 8192 ** 3 / ms / 1e9
        print(f"ceilings: d2d copy {self.results['copy_TBps']:.2f} TB/s, "
              f"bf16 matmul {self.results['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative-norm error of a against b, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
