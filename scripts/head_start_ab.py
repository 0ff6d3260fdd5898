"""The prefill graphs' head start (docs/cuda_graphs.md, "Head start") on and off in ONE engine,
interleaved: the time to first token of lone prompts (fresh, and follow-up suffixes after a
cached history) with the head replayed before the step's planning (`on`) or back to back with
the rest of the forward after it (`off`: the same two graphs, started late). One process, so
the GPU's clocks and the host's speed are the same for both arms; rounds in the order on, off,
off, on, then off, on, on, off, ...

    python scripts/head_start_ab.py --preset nemotron-nano-9b-v2 --fresh 32,128,512,2048 \\
        --follow-up 32,128 --cached-prefix-len 2048 --rounds 6 --out head_ab.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics

ARMS = ("on", "off")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="nemotron-nano-9b-v2")
    ap.add_argument("--fresh", default="32,128,512,2048", help="fresh prompt lengths")
    ap.add_argument("--follow-up", default="32,128", help="suffix lengths after the history")
    ap.add_argument("--cached-prefix-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--head-min-tokens", type=int, default=0,
                    help="the smallest bucket given a head (engine/prefill_graph.py's "
                    "HEAD_MIN_TOKENS; 0: every prefill-only bucket, so every size is timed)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (float32, "
                    "uncaptured graphs up to 64 tokens)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch

    from mambaserve.bench.one_batch import OneBatchConfig, int_list
    from mambaserve.bench.one_batch_backends import MambaserveBackend
    from mambaserve.bench.presets import materialize_preset
    from mambaserve.engine import prefill_graph

    prefill_graph.HEAD_MIN_TOKENS = a.head_min_tokens  # before the engine captures its graphs

    fresh, follow = int_list(a.fresh) if a.fresh else [], \
        int_list(a.follow_up) if a.follow_up else []
    P = a.cached_prefix_len
    cpu = a.device == "cpu"
    dtype = torch.float32 if cpu else torch.bfloat16
    path, load_format, tmp = materialize_preset(a.preset, None, dtype=dtype, device=a.device)
    c = OneBatchConfig(preset=a.preset, batch_sizes=[1], input_lens=fresh + follow,
                       output_len=1, device=a.device, dtype=str(dtype).split(".")[1],
                       cached_prefix_len=P,
                       engine={"enforce_eager": False, "async_scheduling": True,
                               "enable_prefix_caching": True,
                               **({"cuda_graph_max_prefill_tokens": 64} if cpu else {})})
    backend = MambaserveBackend(path, c, load_format)
    graphs = backend.engine.runner.prefill_graph_runner
    started = {arm: 0 for arm in ARMS}  # steps whose head started before their planning
    start_head, arm_now = graphs.start_head, ["on"]

    def counting_start_head(batch):
        ok = start_head(batch)
        started[arm_now[0]] += ok
        return ok

    graphs.start_head = counting_start_head
    cases = [(f"fresh {n}", n, 0) for n in fresh] + [(f"{n} after {P}", n, P) for n in follow]
    times: dict[str, dict[str, list[float]]] = {name: {arm: [] for arm in ARMS}
                                                for name, _, _ in cases}
    seed = 1
    for r in range(a.rounds + 1):  # round 0: warm-up (each shape's templates, compiles)
        order = ARMS + ARMS[::-1] if r % 2 else ARMS[::-1] + ARMS
        for name, n, prefix in cases:
            backend.prefix_len = prefix
            for arm in order:
                graphs.head_start, arm_now[0] = arm == "on", arm
                seed += 1
                ttft, _ = backend.run(1, n, 1, seed)
                if r:
                    times[name][arm].append(ttft * 1e3)
    graphs.head_start = True
    rows = []
    print(f"{a.preset}: TTFT ms, median of {2 * a.rounds} per arm (head start on / off; steps "
          f"started early: {started})")
    print("| prompt | on | off | off - on |")
    print("|---|---|---|---|")
    for name, _, _ in cases:
        on, off = (statistics.median(times[name][arm]) for arm in ARMS)
        rows.append({"prompt": name, "on_ms": times[name]["on"], "off_ms": times[name]["off"]})
        print(f"| {name} | {on:.2f} | {off:.2f} | {off - on:+.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"preset": a.preset, "rounds": a.rounds, "started": started,
                       "rows": rows}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
