"""The small per-layer kernels of a decode step (RMSNorm with the residual add, the Mamba gated
norm, the state update, the conv step) at the presets' shapes: device time of one call for each
launch setting of their tuning entries, T decode rows, timed through a CUDA graph as a decode
step pays them (the state update and conv step on distinct state copies,
together larger than L2, so each call reads its state from HBM), each setting's output checked
against the default's.
Prints a table and the best setting per kernel and shape.

    python scripts/decode_small_kernels_sweep.py --out decode_small_kernels.json   # on a GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile

import torch

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.bench.presets import preset_config, write_config
from mambaserve.config import ModelConfig
from mambaserve.ops.conv1d import causal_conv1d_update
from mambaserve.ops.gated_rmsnorm import gated_rmsnorm
from mambaserve.ops.rmsnorm import rms_norm
from mambaserve.ops.selective_state_update import selective_state_update
from mambaserve.ops.triton import tuning

PRESETS = ["nemotron-nano-9b-v2", "falcon-h1-7b", "granite-4.0-h-micro"]
STATE_BYTES = 256 << 20  # state copies per timed graph: several times the 50 MB L2 ...
MAX_COPIES = 64  # ... up to this many graph nodes per round


def config_of(name: str) -> ModelConfig:
    with tempfile.TemporaryDirectory() as d:
        return ModelConfig.from_hf(write_config(preset_config(name), d))


def settings(**values) -> list[dict]:
    """Every combination of the knobs' candidate values, the default (None / {}) first."""
    keys = list(values)
    return [{}] + [dict(zip(keys, combo)) for combo in itertools.product(*values.values())]


def sweep(entry: str, candidates: list[dict], run, check) -> list[dict]:
    """Time `run` (a list of callables, one call each) under each setting; `check()` -> output
    compared with the default setting's."""
    rows, want = [], None
    for knobs in candidates:
        try:
            with tuning.override(entry, **knobs):
                out = check()
                if want is None:
                    want = out
                elif not torch.allclose(out.float(), want.float(), rtol=1e-2, atol=1e-2):
                    rows.append({"knobs": knobs, "error": "differs from the default"})
                    continue
                rows.append({"knobs": knobs, "us": graph_time_us(fns=run)})
        except Exception as e:  # a setting the kernel cannot compile (shared memory, registers)
            rows.append({"knobs": knobs, "error": f"{type(e).__name__}: {str(e)[:80]}"})
    return rows


def cases(cfg: ModelConfig, T: int, dev="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.float32).to(dt)

    D, H, P, N, G = (cfg.hidden_size, cfg.mamba_num_heads, cfg.mamba_head_dim,
                     cfg.ssm_state_size, cfg.n_groups)
    Di, C, Kc = cfg.mamba_intermediate_size, cfg.conv_dim, cfg.conv_kernel
    x, r, w = rnd(T, D), rnd(T, D), rnd(D)
    yield "rms_norm", settings(num_warps=[1, 2, 4, 8, 16]), \
        [lambda: rms_norm(x, w, 1e-5, r)], lambda: rms_norm(x, w, 1e-5, r)[0]
    y, z, wn = rnd(T, Di), rnd(T, Di), rnd(Di)
    yield "gated_rmsnorm", settings(num_warps=[1, 2, 4, 8]), \
        [lambda: gated_rmsnorm(y, z, wn, Di // G, 1e-5)], \
        lambda: gated_rmsnorm(y, z, wn, Di // G, 1e-5)
    slots = torch.arange(T, device=dev, dtype=torch.int32)
    n_state = min(MAX_COPIES, max(2, STATE_BYTES // ((T + 1) * H * P * N * 4)))
    states = [torch.zeros(T + 1, H, P, N, device=dev) for _ in range(n_state)]
    fresh = rnd(T + 1, H, P, N, dt=torch.float32)  # the checks' state (the timed ones drift)
    xs, dt, B, Cm = rnd(T, H, P), rnd(T, H), rnd(T, G, N), rnd(T, G, N)
    A, Dd, dtb = -torch.rand(H, device=dev), rnd(H, dt=torch.float32), rnd(H, dt=torch.float32)
    lim = (0.0, float("inf"))

    def ssu(s):
        return selective_state_update(s, xs, dt, A, B, Cm, Dd, dtb, lim, slots)

    yield "selective_state_update", settings(
        block_p=[4, 8, 16, 32, 64], num_warps=[1, 2, 4, 8]), \
        [lambda s=s: ssu(s) for s in states], lambda: ssu(fresh.clone())
    n_conv = min(MAX_COPIES, max(2, STATE_BYTES // ((T + 1) * (Kc - 1) * C * 2)))
    convs = [torch.zeros(T + 1, Kc - 1, C, device=dev, dtype=dtype) for _ in range(n_conv)]
    fresh_conv = rnd(T + 1, Kc - 1, C)
    xc, cw, cb = rnd(T, C), rnd(C, Kc), rnd(C)
    yield "conv1d_update", settings(block_d=[64, 128, 256, 512, 1024],
                                    num_warps=[1, 2, 4, 8]), \
        [lambda s=s: causal_conv1d_update(xc, cw, cb, s, slots) for s in convs], \
        lambda: causal_conv1d_update(xc, cw, cb, fresh_conv.clone(), slots)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--rows", default="1,8", help="decode rows T")
    ap.add_argument("--kernels", default=None, help="comma-separated: only these entries")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for name in args.presets.split(","):
        cfg = config_of(name)
        for T in (int(t) for t in args.rows.split(",")):
            for entry, candidates, run, check in cases(cfg, T):
                if args.kernels and entry not in args.kernels.split(","):
                    continue
                rows = sweep(entry, candidates, run, check)
                timed = [r for r in rows if "us" in r]
                best = min(timed, key=lambda r: r["us"])
                print(f"{name:22s} T={T} {entry:24s} default {timed[0]['us']:6.2f} us, best "
                      f"{best['us']:6.2f} us at {best['knobs']}  "
                      f"({len(rows) - len(timed)} settings failed)", flush=True)
                results.append({"preset": name, "T": T, "kernel": entry, "rows": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
