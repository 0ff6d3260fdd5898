"""The few-rows linear (`ops/triton/gemv.py`) against cuBLAS (`x @ w.t()`) at every decode
projection shape of the presets, M = 1 and 8 token rows (`--m`: any, above the dispatch's `max_m`
too), bf16: device time per call through CUDA
graphs, each call on its own copy of the weight so that the copies together exceed the L2 cache
(every call reads its weight from HBM, as in a decode step), and weight bytes over time against
the copy ceiling. Each candidate launch (a set of knobs of the tuning entry "gemv") is checked
against a float32 product first. Prints the table per shape, the best candidate per shape, and per
candidate the geometric mean of cuBLAS time / its time.

    python scripts/gemv_sweep.py --out gemv_sweep.json          # on a GPU
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mambaserve.bench.graph_timing import graph_time_us
from mambaserve.bench.roofline import copy_ceiling
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.gemv import gemv_triton, launch_plan

# (preset, projection, N, K): the presets' decode linears (q/k/v packed; Falcon-H1's Mamba in_proj
# with its q/k/v; gate|up stacked)
SHAPES = [
    ("nemotron-nano-9b-v2", "mamba in_proj", 22656, 4480),
    ("nemotron-nano-9b-v2", "mamba out_proj", 4480, 10240),
    ("nemotron-nano-9b-v2", "mlp up", 15680, 4480),
    ("nemotron-nano-9b-v2", "mlp down", 4480, 15680),
    ("nemotron-nano-9b-v2", "lm_head", 131072, 4480),
    ("falcon-h1-7b", "in_proj + qkv", 8728, 3072),
    ("falcon-h1-7b", "gate|up", 24576, 3072),
    ("falcon-h1-7b", "mlp down", 3072, 12288),
    ("falcon-h1-7b", "mamba out_proj", 3072, 3072),
    ("falcon-h1-7b", "o_proj", 3072, 1536),
    ("granite-4.0-h-micro", "mamba in_proj", 8512, 2048),
    ("granite-4.0-h-micro", "mamba out_proj", 2048, 4096),
    ("granite-4.0-h-micro", "gate|up", 16384, 2048),
    ("granite-4.0-h-micro", "mlp down", 2048, 8192),
    ("mamba-codestral-7b", "mamba in_proj", 18560, 4096),
    ("mamba-codestral-7b", "mamba out_proj", 4096, 8192),
]

# candidate knob sets: FMAs (one or two rows) and tensor cores
CANDIDATES = [
    {"use_dot": False, "block_n": 4, "block_k": 512, "num_warps": 4},
    {"use_dot": False, "block_n": 8, "block_k": 256, "num_warps": 4},
    {"use_dot": False, "block_n": 8, "block_k": 512, "num_warps": 8},
    {"use_dot": False, "block_n": 16, "block_k": 128, "num_warps": 4},
    {"use_dot": False, "block_n": 16, "block_k": 256, "num_warps": 8},
    {"use_dot": False, "block_n": 8, "block_k": 256, "num_warps": 4, "split_k": 1},
    {"use_dot": False, "block_n": 8, "block_k": 1024, "num_warps": 8},
    {"use_dot": False, "block_n": 4, "block_k": 1024, "num_warps": 4},
    {"use_dot": False, "block_n": 16, "block_k": 512, "num_warps": 8},
    {"use_dot": True, "block_n": 16, "block_k": 256, "num_stages": 4},
    {"use_dot": True, "block_n": 16, "block_k": 512, "num_stages": 3},
    {"use_dot": True, "block_n": 16, "block_k": 128, "num_stages": 6},
    {"use_dot": True, "block_n": 32, "block_k": 256, "num_stages": 4},
    {"use_dot": True, "block_n": 32, "block_k": 128, "num_stages": 4},
    {"use_dot": True, "block_n": 64, "block_k": 128, "num_stages": 4},
    {"use_dot": True, "block_n": 64, "block_k": 256, "num_stages": 3, "num_warps": 8},
    {"use_dot": True, "block_n": 16, "block_k": 256, "num_stages": 4, "split_k": 1},
    {"use_dot": True, "block_n": 32, "block_k": 256, "num_stages": 4, "split_k": 1},
]
L2_BYTES = 256 << 20  # weight copies per shape until their bytes exceed this (H200 L2: 50 MiB)


def name(c: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    ceiling = copy_ceiling(torch.device("cuda"))["bytes_per_s"]
    rows = []
    print(f"copy ceiling {ceiling / 1e9:.0f} GB/s")
    print("| preset | projection | N x K | M | cuBLAS us (% copy) | default plan us (% copy) | "
          "best us (% copy) | best candidate |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, proj, N, K in SHAPES:
        nbytes = 2 * N * K
        copies = max(1, min(32, math.ceil(L2_BYTES / nbytes)))
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ ws[0].float().t())
            tol = 2e-2 * ref.abs().max().item() + 1e-3
            pct = lambda us: 100 * nbytes / (us * 1e-6) / ceiling  # noqa: E731
            t_cublas = graph_time_us(fns=[lambda w=w: x @ w.t() for w in ws])
            row = {"preset": preset, "proj": proj, "N": N, "K": K, "M": M,
                   "cublas_us": t_cublas, "cublas_pct": pct(t_cublas), "candidates": []}
            with tuning.override("gemv", max_m=max(M, 8)):  # M above the dispatch's bound
                t_default = graph_time_us(fns=[lambda w=w: gemv_triton(x, w) for w in ws])
                row.update(default_us=t_default, default_pct=pct(t_default),
                           default_plan=launch_plan(M, N, K, x.device))
            for c in CANDIDATES:
                if not c["use_dot"] and M > 2:
                    continue
                try:
                    with tuning.override("gemv", max_m=max(M, 8), **c):
                        err = (gemv_triton(x, ws[0]).float() - ref).abs().max().item()
                        t = graph_time_us(fns=[lambda w=w: gemv_triton(x, w) for w in ws])
                        plan = launch_plan(M, N, K, x.device)
                    row["candidates"].append({"knobs": c, "us": t, "pct": pct(t), "err": err,
                                              "ok": err <= tol, "split_k": plan["split_k"]})
                except Exception as e:  # noqa: BLE001 - one failing launch leaves the others
                    row["candidates"].append({"knobs": c, "error": f"{type(e).__name__}: "
                                              f"{str(e).splitlines()[0][:200]}"})
            good = [r for r in row["candidates"] if r.get("ok")]
            best = min(good, key=lambda r: r["us"]) if good else None
            rows.append(row)
            b = "-" if best is None else f"{best['us']:.1f} ({best['pct']:.0f} %)"
            bn = "-" if best is None else f"{name(best['knobs'])} split {best['split_k']}"
            print(f"| {preset} | {proj} | {N} x {K} | {M} | {t_cublas:.1f} ({pct(t_cublas):.0f} %) "
                  f"| {t_default:.1f} ({pct(t_default):.0f} %) | {b} | {bn} |")
            bad = [r for r in row["candidates"] if "error" in r or not r.get("ok")]
            for r in bad:
                print(f"   FAILED {name(r['knobs'])}: {r.get('error') or r.get('err')}")
        del ws
    print("\n| candidate | M | geomean cuBLAS / candidate | min | shapes |")
    print("|---|---|---|---|---|")
    for c in CANDIDATES:
        for M in sorted({r["M"] for r in rows}):
            ratios = [r["cublas_us"] / x["us"] for r in rows if r["M"] == M
                      for x in r["candidates"] if x["knobs"] is c and x.get("ok")]
            if ratios:
                gm = math.exp(sum(math.log(v) for v in ratios) / len(ratios))
                print(f"| {name(c)} | {M} | {gm:.3f} | {min(ratios):.3f} | {len(ratios)} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_ceiling": ceiling,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
