"""Run a `mambaserve` command and log every Triton compile and autotune it triggers, with the
time it took and the run it fell in: finds kernels that compile outside the warm-up (a new
specialization of an integer argument, a new autotune key).

    python3 scripts/trace_compiles.py bench one-batch --preset granite-4.0-h-micro \\
        --device cuda --dtype bfloat16 --batch-size 1,8 --input-len 2048 --output-len 8

Each `bench one-batch` run (warm-up and timed) is bracketed by `run ...` / `end ...` lines.
"""

from __future__ import annotations

import sys
import time

from triton.runtime import autotuner, jit

T0 = time.perf_counter()


def _stamp() -> str:
    return f"[{time.perf_counter() - T0:8.2f}s]"


_compile = jit.JITFunction._do_compile


def _traced_compile(self, key, *args, **kwargs):
    t = time.perf_counter()
    out = _compile(self, key, *args, **kwargs)
    print(f"{_stamp()} compile {self.fn.__qualname__} {1e3 * (time.perf_counter() - t):.0f} ms "
          f"key={str(key)[:300]}", flush=True)
    return out


jit.JITFunction._do_compile = _traced_compile

_bench = autotuner.Autotuner._bench


def _traced_bench(self, *args, **kwargs):
    out = _bench(self, *args, **kwargs)
    print(f"{_stamp()} autotune-bench {self.base_fn.__qualname__}", flush=True)
    return out


autotuner.Autotuner._bench = _traced_bench


def _bracket_one_batch() -> None:
    from mambaserve.bench import one_batch_backends

    run = one_batch_backends.MambaserveBackend.run

    def traced(self, b, n, out_len, seed):
        print(f"{_stamp()} run b={b} n={n} out={out_len} seed={seed}", flush=True)
        t = time.perf_counter()
        res = run(self, b, n, out_len, seed)
        print(f"{_stamp()} end b={b} n={n}: {time.perf_counter() - t:.3f} s, prefill "
              f"{res[0] * 1e3:.1f} ms", flush=True)
        return res

    one_batch_backends.MambaserveBackend.run = traced


if __name__ == "__main__":
    _bracket_one_batch()
    from mambaserve.cli import main

    sys.exit(main(sys.argv[1:]))
