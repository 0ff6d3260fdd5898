"""The few-rows linear's one-row launch rules inside the engine: batch-1 decode of a preset under
`bench profile --by-grid`, with the launcher's rules (`default`) or with CUDA-core FMAs at every
one-row shape (`fma-one-row`: 4-column blocks where N > 3 K, else 8 when the 8-column blocks
number >= 2 per SM, else 4). In isolation (`scripts/gemv_sweep.py --m 1`) the second set reads
the wide projections 5-15 % faster, yet in the engine it made decode steps slower
(docs/kernels.md); this times every projection's launches inside the replayed decode step (one
row per launch grid) and the step itself, so the two runs say where the difference is.

    python scripts/gemv_rules_in_engine.py --preset granite-4.0-h-micro --rules default \\
        --out default.json                                                    # on a GPU
    python scripts/gemv_rules_in_engine.py --preset granite-4.0-h-micro --rules fma-one-row \\
        --out fma.json
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
import triton

RULES = ("default", "fma-one-row")


def use_fma_one_row() -> None:
    """Route every one-row launch plan of the few-rows linear to CUDA-core FMAs (the engine's
    launches look `launch_plan` up in the module at each call, so this takes effect for the
    graphs captured afterwards)."""
    from mambaserve.ops.triton import gemv, tuning
    from mambaserve.ops.triton._common import num_sms

    rules = gemv.launch_plan

    def launch_plan(M, N, K, device):
        if M != 1:
            return rules(M, N, K, device)
        wide = N > 3 * K
        block_n = 4 if wide else (8 if triton.cdiv(N, 8) >= 2 * num_sms(torch.device(device))
                                  else 4)
        with tuning.override("gemv", use_dot=False, block_n=block_n):
            return rules(M, N, K, device)

    gemv.launch_plan = launch_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    ap.add_argument("--rules", choices=RULES, default="default")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--out", default=None, help="write the phases as JSON")
    a = ap.parse_args()

    from mambaserve.bench.one_batch import OneBatchConfig
    from mambaserve.bench.profile import profile_batch

    if a.rules == "fma-one-row":
        use_fma_one_row()
    c = OneBatchConfig(preset=a.preset, batch_sizes=[1], input_lens=[a.input_len],
                       device="cuda", dtype="bfloat16", engine={"enforce_eager": False})
    phases = profile_batch(c, decode_steps=a.steps, top=200, by_grid=True, log=lambda s: None)
    dec = next(p for p in phases if p.phase == "decode")
    per = 1e3 / dec.steps
    print(f"{a.preset}, rules {a.rules}: decode {dec.wall_s * per:.3f} ms/step wall, device "
          f"busy {dec.device_busy_s * per:.3f} ms/step, matmul "
          f"{dec.groups.get('matmul', 0.0) * per:.3f} ms/step")
    print("| launch | us per call | calls/step |")
    print("|---|---|---|")
    for name, s, calls in sorted(dec.top):
        if "gemv" in name:
            print(f"| `{name}` | {1e6 * s / calls:.1f} | {calls / dec.steps:g} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "rules": a.rules,
                       "phases": [asdict(p) for p in phases]}, f, indent=1)


if __name__ == "__main__":
    main()
