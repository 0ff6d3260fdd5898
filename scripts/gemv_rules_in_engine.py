"""The few-rows linear's launch rules inside the engine: decode of a preset (`--batch-size` rows)
under `bench profile --by-grid`, with the launcher's rules (`default`) or with CUDA-core FMAs at
every one-row shape (`fma-one-row`: 4-column blocks where N > 3 K, else 8 when the 8-column
blocks number >= 2 per SM, else 4). In isolation (`scripts/gemv_sweep.py --m 1`) the second set
reads the wide projections 5-15 % faster, yet in the engine it made decode steps slower
(docs/kernels.md); this times every projection's launches inside the replayed decode step (one
row per launch grid) and the step itself, so the two runs say where the difference is.
`--narrow k=v,...`: knobs of the tuning entry "gemv" for the tensor-core launches of the narrow
products (three or more rows, N <= 3 K: the 9B's out_proj, down, o_proj at batch 8), on top of
either rule set.

    python scripts/gemv_rules_in_engine.py --preset granite-4.0-h-micro --rules default \\
        --out default.json                                                    # on a GPU
    python scripts/gemv_rules_in_engine.py --preset granite-4.0-h-micro --rules fma-one-row \\
        --out fma.json
    python scripts/gemv_rules_in_engine.py --preset nemotron-nano-9b-v2 --batch-size 8 \\
        --narrow block_n=16,split_k=1
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

    def launch_plan(M, N, K, device, dot=True):
        if M != 1 or not dot:
            return rules(M, N, K, device, dot)
        wide = N > 3 * K
        block_n = 4 if wide else (8 if triton.cdiv(N, 8) >= 2 * num_sms(torch.device(device))
                                  else 4)
        with tuning.override("gemv", use_dot=False, block_n=block_n):
            return rules(M, N, K, device, dot)

    gemv.launch_plan = launch_plan


def parse_knobs(text: str) -> dict:
    """`k=v,...` (values Python literals) -> a dict of knobs."""
    import ast

    knobs = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        knobs[key.strip()] = ast.literal_eval(value.strip())
    return knobs


def use_narrow_knobs(knobs: dict) -> None:
    """Launch the narrow products (M > 2, N <= 3 K) on tensor cores with `knobs` on top of the
    rules in place (as `use_fma_one_row`, for the graphs captured afterwards)."""
    from mambaserve.ops.triton import gemv, tuning

    rules = gemv.launch_plan

    def launch_plan(M, N, K, device, dot=True):
        if M <= 2 or N > 3 * K or not dot:
            return rules(M, N, K, device, dot)
        with tuning.override("gemv", use_dot=True, **knobs):
            return rules(M, N, K, device, dot)

    gemv.launch_plan = launch_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="granite-4.0-h-micro")
    ap.add_argument("--rules", choices=RULES, default="default")
    ap.add_argument("--batch-size", type=int, default=1, help="decode rows")
    ap.add_argument("--narrow", default="", help="k=v,... knobs for the narrow products")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--out", default=None, help="write the phases as JSON")
    a = ap.parse_args()

    from mambaserve.bench.one_batch import OneBatchConfig
    from mambaserve.bench.profile import profile_batch

    if a.rules == "fma-one-row":
        use_fma_one_row()
    if a.narrow:
        use_narrow_knobs(parse_knobs(a.narrow))
    c = OneBatchConfig(preset=a.preset, batch_sizes=[a.batch_size], input_lens=[a.input_len],
                       device="cuda", dtype="bfloat16",
                       engine={"enforce_eager": False, "chunked_prefill_size": 16384})
    phases = profile_batch(c, decode_steps=a.steps, top=200, by_grid=True, log=lambda s: None)
    dec = next(p for p in phases if p.phase == "decode")
    per = 1e3 / dec.steps
    print(f"{a.preset}, batch {a.batch_size}, rules {a.rules} {a.narrow}: decode "
          f"{dec.wall_s * per:.3f} ms/step wall, device busy {dec.device_busy_s * per:.3f} "
          f"ms/step, matmul "
          f"{dec.groups.get('matmul', 0.0) * per:.3f} ms/step")
    print("| launch | us per call | calls/step |")
    print("|---|---|---|")
    for name, s, calls in sorted(dec.top):
        if "gemv" in name or "relu2" in name:
            print(f"| `{name}` | {1e6 * s / calls:.1f} | {calls / dec.steps:g} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "rules": a.rules, "narrow": a.narrow,
                       "batch_size": a.batch_size,
                       "phases": [asdict(p) for p in phases]}, f, indent=1)


if __name__ == "__main__":
    main()
