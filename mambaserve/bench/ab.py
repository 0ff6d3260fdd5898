"""`mambaserve bench ab`: compare two engine settings, A/B with interleaved rounds and a drift
control.

    mambaserve bench ab --preset nemotron-nano-9b-v2 --device cuda \\
        --a "enforce_eager=true" --b "enforce_eager=false" --rounds 4 \\
        --num-prompts 32 --input-len 256 --output-len 128

- Both arms are engines built from the same checkpoint (`--base` settings, then `--a` / `--b`).
- Interleaved rounds: A B B A, then B A A B, ... so a drifting machine affects both arms alike.
- Drift control: every round measures each arm twice; the A-vs-A relative difference (same
  arm, same session) is the noise floor. A B-vs-A difference within it is "inconclusive".
- Warm-up: before every measured range a few warm-up requests run and are not timed.
- Disjoint seed ranges: every measured range (round x position) and every warm-up draws its
  prompts from its own seeds, so a prefix cache never hits on prompts sent before.
- The figure is output tokens/s of a fixed workload (N prompts of L tokens, O greedy output
  tokens each, submitted at once, timed until the last finishes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mambaserve.bench.one_batch import parse_settings
from mambaserve.config import resolve_device

SEED_STRIDE = 1_000_003  # seeds of one range: base + i for i < num_prompts (far below the stride)


@dataclass
class ABConfig:
    model: str | None = None
    preset: str | None = None
    save_reload: str | None = None
    a: dict = field(default_factory=dict)
    b: dict = field(default_factory=dict)
    base: dict = field(default_factory=dict)
    rounds: int = 3
    num_prompts: int = 8
    input_len: int = 64
    output_len: int = 32
    warmup_prompts: int = 2
    device: str = "auto"  # cuda when torch sees a CUDA device, else cpu
    dtype: str = "auto"
    seed: int = 0

    def validate(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError("give exactly one of --model PATH or --preset NAME")
        if self.rounds < 1 or self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("rounds, num-prompts, input-len and output-len must be >= 1")
        if self.warmup_prompts < 0:
            raise ValueError("warmup-prompts must be >= 0")
        if self.preset is not None:
            from mambaserve.bench.presets import preset_config

            preset_config(self.preset)  # an unknown name fails here, not after a load
        self.device = resolve_device(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")


def schedule(rounds: int) -> list[list[str]]:
    """A B B A, B A A B, A B B A, ...: each round measures each arm twice."""
    return [["A", "B", "B", "A"] if r % 2 == 0 else ["B", "A", "A", "B"] for r in range(rounds)]


def range_seed(seed: int, round_: int, position: int, warmup: bool = False) -> int:
    """First seed of a measured (or warm-up) range; ranges never overlap."""
    return seed + SEED_STRIDE * (1 + 2 * (round_ * 4 + position) + (1 if warmup else 0))


def workload(vocab_size: int, num_prompts: int, input_len: int, first_seed: int
             ) -> list[list[int]]:
    return [torch.randint(3, vocab_size, (input_len,),
                          generator=torch.Generator().manual_seed(first_seed + i)).tolist()
            for i in range(num_prompts)]


def _rel(x: float, ref: float) -> float:
    return (x - ref) / ref if ref else float("nan")


def analyze(rows: list[dict]) -> dict:
    """rows: {"round", "position", "arm", "tokens_per_s"}. Per round, each arm's two
    measurements give a same-arm spread; the verdict compares the median B/A difference with the
    largest A-vs-A spread of the session."""
    rounds = sorted({r["round"] for r in rows})
    per_round, a_spreads, b_spreads = [], [], []
    for k in rounds:
        a = [r["tokens_per_s"] for r in rows if r["round"] == k and r["arm"] == "A"]
        b = [r["tokens_per_s"] for r in rows if r["round"] == k and r["arm"] == "B"]
        am, bm = statistics.mean(a), statistics.mean(b)
        aa = abs(_rel(a[1], a[0])) if len(a) > 1 else 0.0
        bb = abs(_rel(b[1], b[0])) if len(b) > 1 else 0.0
        a_spreads.append(aa)
        b_spreads.append(bb)
        per_round.append({"round": k, "A": a, "B": b, "A_mean": am, "B_mean": bm,
                          "B_vs_A": _rel(bm, am), "A_vs_A": aa, "B_vs_B": bb})
    med_a = statistics.median(x for r in rows if r["arm"] == "A" for x in [r["tokens_per_s"]])
    med_b = statistics.median(x for r in rows if r["arm"] == "B" for x in [r["tokens_per_s"]])
    diff = _rel(med_b, med_a)
    round_diffs = [r["B_vs_A"] for r in per_round]
    spread = max(a_spreads)
    conclusive = abs(diff) > spread and all((d > 0) == (diff > 0) for d in round_diffs)
    if not conclusive:
        verdict = "inconclusive"
    else:
        verdict = f"B {'faster' if diff > 0 else 'slower'} by {100 * abs(diff):.1f} %"
    return {"per_round": per_round, "median_A": med_a, "median_B": med_b, "relative_diff": diff,
            "round_diffs": round_diffs, "A_vs_A_spread": spread, "B_vs_B_spread": max(b_spreads),
            "conclusive": conclusive, "verdict": verdict}


def format_report(res: dict, unit: str = "output tokens/s") -> str:
    lines = [(f"{'round':>5}  {'A (' + unit + ')':>28}  {'B (' + unit + ')':>28}  "
             f"{'B vs A':>8}  {'A vs A':>8}")]
    for r in res["per_round"]:
        lines.append(f"{r['round']:>5}  {', '.join(f'{x:,.1f}' for x in r['A']):>28}  "
                     f"{', '.join(f'{x:,.1f}' for x in r['B']):>28}  "
                     f"{100 * r['B_vs_A']:>+7.1f}%  {100 * r['A_vs_A']:>7.1f}%")
    lines += [
        (f"median A {res['median_A']:,.1f}, median B {res['median_B']:,.1f}: B vs A "
        f"{100 * res['relative_diff']:+.1f} % (rounds: "
        f"{', '.join(f'{100 * d:+.1f}%' for d in res['round_diffs'])})"),
        (f"drift control: A-vs-A spread {100 * res['A_vs_A_spread']:.1f} % (B-vs-B "
        f"{100 * res['B_vs_B_spread']:.1f} %)"),
        f"verdict: {res['verdict']}" + ("" if res["conclusive"] else
                                        " (difference within the A-vs-A spread or the rounds "
                                        "disagree in sign)"),
    ]
    return "\n".join(lines)


class _Arm:
    def __init__(self, path: Path, settings: dict) -> None:
        from mambaserve.config import EngineConfig
        from mambaserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(path, EngineConfig(**settings))
        self.counter = 0

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        """Seconds until every prompt has its output_len tokens."""
        from mambaserve.engine.sampling_params import SamplingParams

        eng = self.engine
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)
        t0 = time.perf_counter()
        for p in prompts:
            self.counter += 1
            eng.add_request(f"ab{self.counter}", {"prompt_token_ids": p}, params)
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t0  # every step ends with a read-back: synced


def run_ab(c: ABConfig, log=print) -> dict:
    from mambaserve.bench.presets import materialize_preset
    from mambaserve.config import ModelConfig, resolve_dtype

    c.validate()
    tmp = None
    load = {}
    if c.preset:  # with dummy weights both arms draw the same values (same seed)
        wdtype = torch.bfloat16 if c.dtype == "auto" else resolve_dtype(c.dtype)
        path, load_format, tmp = materialize_preset(c.preset, c.save_reload, dtype=wdtype,
                                                    device=c.device, seed=c.seed)
        load = {"load_format": load_format, "seed": c.seed}
    else:
        path = Path(c.model)
    try:
        vocab = ModelConfig.from_hf(path).vocab_size
        base = {"device": c.device, "dtype": c.dtype, "max_num_seqs": c.num_prompts,
                "max_model_len": c.input_len + c.output_len + 16, **load, **c.base}
        arms = {"A": _Arm(path, {**base, **c.a}), "B": _Arm(path, {**base, **c.b})}
        log(f"A: {c.a or '(base)'}   B: {c.b or '(base)'}   base: {base}")
        log(f"workload: {c.num_prompts} prompts x {c.input_len} tokens, {c.output_len} output "
            f"tokens each; {c.rounds} rounds; {c.warmup_prompts} warm-up prompts per range")
        rows = []
        for k, order in enumerate(schedule(c.rounds)):
            for pos, arm in enumerate(order):
                if c.warmup_prompts:
                    arms[arm].run(workload(vocab, c.warmup_prompts, c.input_len,
                                           range_seed(c.seed, k, pos, warmup=True)),
                                  c.output_len)
                prompts = workload(vocab, c.num_prompts, c.input_len, range_seed(c.seed, k, pos))
                secs = arms[arm].run(prompts, c.output_len)
                tps = c.num_prompts * c.output_len / secs
                rows.append({"round": k, "position": pos, "arm": arm, "seconds": secs,
                             "tokens_per_s": tps})
                log(f"round {k} {pos} {arm}: {tps:,.1f} output tokens/s ({secs:.3f} s)")
    finally:
        if tmp is not None:
            tmp.cleanup()
    res = analyze(rows)
    res["rows"] = rows
    res["config"] = asdict(c)
    return res


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", default=None, help="HF checkpoint folder")
    src.add_argument("--preset", default=None, help="nemotron-nano-9b-v2 | tiny (random weights)")
    p.add_argument("--save-reload", default=None, metavar="DIR",
                   help="write the preset as a full checkpoint into DIR and load it (default: "
                        "random weights drawn on the device, load_format=dummy)")
    p.add_argument("--a", default="", metavar="K=V,...", help="EngineConfig settings of arm A")
    p.add_argument("--b", default="", metavar="K=V,...", help="EngineConfig settings of arm B")
    p.add_argument("--base", default="", metavar="K=V,...", help="settings of both arms")
    p.add_argument("--rounds", type=int, default=3, help="each runs A and B twice")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per measured range")
    p.add_argument("--input-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--output-len", type=int, default=32, help="greedy output tokens per prompt")
    p.add_argument("--warmup-prompts", type=int, default=2,
                   help="untimed prompts before every measured range")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N; auto: cuda when torch sees a CUDA device")
    p.add_argument("--dtype", default="auto", help="the engine's --dtype")
    p.add_argument("--seed", type=int, default=0, help="prompts and random weights")
    p.add_argument("--out", default=None, help="write per-round numbers and the verdict as JSON")


def run_cli(a: argparse.Namespace) -> int:
    """`mambaserve bench ab`; a bad setting is a ValueError (one line from the CLI)."""
    c = ABConfig(model=a.model, preset=a.preset, save_reload=a.save_reload,
                 a=parse_settings(a.a), b=parse_settings(a.b), base=parse_settings(a.base),
                 rounds=a.rounds, num_prompts=a.num_prompts, input_len=a.input_len,
                 output_len=a.output_len, warmup_prompts=a.warmup_prompts,
                 device=a.device, dtype=a.dtype, seed=a.seed)
    res = run_ab(c)
    print(format_report(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0
