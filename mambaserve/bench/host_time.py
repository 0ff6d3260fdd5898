"""`mambaserve bench host`: the host's time in a step before the device can start on it.

    mambaserve bench host --preset nemotron-nano-9b-v2 --device cuda --dtype bfloat16 \\
        --input-len 32,512,2048 --decode-batch 1,8,64 --engine enforce_eager=false
    mambaserve bench host --preset nemotron-nano-9b-v2 --narrow --device cpu --dtype float32 \\
        --engine enforce_eager=false,cuda_graph_max_prefill_tokens=256

At batch 1 nothing else runs while the host plans a step, so every microsecond from the call
to `step()` to the forward's first launch is added to the time to first token. What is timed
(the runner's step sections, engine/runner.py):
- `schedule`: from `step()` to the runner's start on the step (scheduling, the engine's
  bookkeeping);
- `start`: from `step()` until the device has the step's first work: the end of the head's
  launch where a prefill-only step started its head before planning (engine/prefill_graph.py,
  "Head start"), else the forward's start (`prefix`);
- `plan`: the sampling plan and the forward's metadata (`plan_metadata`, a decode graph's
  packed inputs);
- `upload`: a prefill graph's bucket packing, the step's one host-to-device copy, the typed
  views over it and the graph buffer's load;
- `prefix`: the whole of it, from `step()` to the forward's start;
- `launch`: the forward call itself on the host (for a graph: the replay's launch, the host
  time before the device can run the graph's first kernel; eager: every layer's launches, which
  the device overlaps with its work).

Scenarios: `prefill N`, the step that runs a lone prompt of N tokens (a new request: TTFT;
with `--cached-prefix-len P`, a follow-up turn: N new tokens after a P-token history prefilled
before, untimed, and served by the prefix cache, which is then on; with `--new-lengths`, the
prompts have the lengths N, N-1, N-2, ..., so that no step finds a template of its length
(engine/prefill_template.py; unless another `--input-len`'s scenario had that length), as a
server's prompts of varied lengths mostly do not);
`decode B`, a steady decode step of B running requests (with overlap scheduling the host plans
it while the device runs the step before, so it must stay below a decode step's device time).
Each figure is the median over `--repeats` steps after warm-up steps of the same shape; the
path says how the forward ran (prefill graph, decode graph, eager).

`--narrow` keeps a preset's layers, chunk size and conv kernel at tiny widths
(`presets.narrow_config`): the host's work per step does not depend on the widths, and a CPU
can run the forward in between. On a CPU the forward runs inside `step()` and its threads
compete with the host code that follows, so CPU figures are for comparing host code, not for
predicting a GPU host's.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mambaserve.bench.one_batch import int_list, parse_settings
from mambaserve.bench.one_batch_backends import prefill_untimed, random_prompts
from mambaserve.config import resolve_device

PHASES = ("schedule", "plan", "upload", "prefix", "start", "launch")


@dataclass
class HostTimeConfig:
    model: str | None = None
    preset: str | None = None
    narrow: bool = False
    input_lens: list[int] = field(default_factory=lambda: [32, 512])
    decode_batches: list[int] = field(default_factory=lambda: [1, 8])
    repeats: int = 20
    warmup: int = 3
    device: str = "auto"
    dtype: str = "bfloat16"
    engine: dict = field(default_factory=dict)
    seed: int = 0
    cached_prefix_len: int = 0  # P: each lone prompt follows a P-token history the cache serves
    cprofile: int = 0  # > 0: the timed prefill steps' prefixes under cProfile, this many listed
    new_lengths: bool = False  # prompt i of a scenario has N - i tokens: no template of its length

    def validate(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError("give exactly one of --model PATH or --preset NAME")
        if self.narrow and self.preset is None:
            raise ValueError("--narrow applies to a --preset")
        if min(self.input_lens + self.decode_batches, default=1) < 1:
            raise ValueError("input-len and decode-batch values must be >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")
        if self.cached_prefix_len < 0:
            raise ValueError(f"--cached-prefix-len must be >= 0, got {self.cached_prefix_len}")
        steps = self.warmup + self.repeats
        if self.new_lengths and min(self.input_lens, default=steps) < steps:
            raise ValueError(f"--new-lengths needs every --input-len >= warmup + repeats "
                             f"({steps}): prompt i has N - i tokens")
        self.device = resolve_device(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")


@dataclass
class HostTimeResult:
    scenario: str  # "prefill N" [" after P"] [" new lengths"] | "decode B"
    path: str  # how the forward ran: prefill graph | decode graph | eager
    us: dict[str, float]  # phase -> median microseconds
    steps: int
    cached_tokens: int = 0  # prefill after a history: the fewest tokens the cache served


class StepClock:
    """The runner's `section` hook: when each labelled phase of a step started and how long it
    took (a phase entered twice in a step adds up)."""

    def __init__(self) -> None:
        self.start: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.start.clear()
        self.seconds.clear()

    @contextlib.contextmanager
    def section(self, label: str):
        t = time.perf_counter()
        self.start.setdefault(label, t)
        try:
            yield
        finally:
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t


class HostTimer:
    """Times `engine.step()` calls phase by phase through the runner's hooks."""

    def __init__(self, engine) -> None:
        self.engine, self.clock = engine, StepClock()
        self.path = ""
        self.outputs: list = []  # the last step's outputs
        self.profile = None  # a cProfile.Profile: `step(profiled=True)`'s prefix runs under it
        self.profiling = False
        runner = engine.runner
        runner.section = self._section
        runner.on_forward = lambda batch, meta: self._note_path(meta)

    def _section(self, label: str):
        """The clock's section; the profiler stops where the forward starts (what it profiles
        is the step's prefix, the host time the device waits for)."""
        if label == "forward" and self.profiling:
            self.profile.disable()
            self.profiling = False
        return self.clock.section(label)

    def _note_path(self, meta) -> None:
        """The path the step took, from the metadata it runs on: a graph runner's own (a
        bucket's) or the step's eager metadata."""
        runner = self.engine.runner
        self.path = "eager"
        for name, graphs in (("prefill graph", runner.prefill_graph_runner),
                             ("decode graph", runner.graph_runner)):
            if graphs is not None and any(meta is m for m in graphs.metas.values()):
                self.path = name

    def step(self, profiled: bool = False) -> dict[str, float] | None:
        """One engine step; its phases in seconds, None when it launched no forward."""
        self.clock.reset()
        t0 = time.perf_counter()
        if profiled and self.profile is not None:
            self.profiling = True
            self.profile.enable()
        self.outputs = self.engine.step()
        if self.profiling:  # no forward in this step
            self.profile.disable()
            self.profiling = False
        c = self.clock
        if "forward" not in c.start:
            return None
        first = c.start.get("head", c.start.get("plan", c.start["forward"]))
        head_end = c.start["head"] + c.seconds["head"] if "head" in c.start else 0.0
        # a head launched: the device started on it (a head section without one is host time)
        start = head_end if self.engine.runner.head_started else c.start["forward"]
        return {"schedule": first - t0,
                "plan": c.seconds.get("plan", 0.0), "upload": c.seconds.get("upload", 0.0),
                "prefix": c.start["forward"] - t0, "start": start - t0,
                "launch": c.seconds["forward"]}

    def close(self) -> None:
        runner = self.engine.runner
        runner.section = lambda label: contextlib.nullcontext()
        runner.on_forward = None


def _median_us(samples: list[dict[str, float]]) -> dict[str, float]:
    return {p: statistics.median(s[p] for s in samples) * 1e6 for p in PHASES}


def time_prefill(timer: HostTimer, vocab: int, n: int, c: HostTimeConfig) -> HostTimeResult:
    """The first step of each of warmup + repeats lone prompts of n tokens."""
    from mambaserve.engine.sampling_params import SamplingParams

    eng, samples, cached, path = timer.engine, [], [], ""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    P = c.cached_prefix_len
    for i in range(c.warmup + c.repeats):
        m = n - i if c.new_lengths else n
        prompt = random_prompts(vocab, 1, m, c.seed + 7919 * n + i)[0]
        if P:  # a follow-up turn: its history first, untimed (the cache then serves it)
            history = random_prompts(vocab, 1, P, c.seed + 104729 + 7919 * n + i)[0]
            prefill_untimed(eng, [history], f"host-history-{n}-{i}")
            prompt = history + prompt
        eng.add_request(f"host-prefill-{n}-{i}", {"prompt_token_ids": prompt}, params)
        first, outs = None, []
        while first is None:
            first = timer.step(profiled=i >= c.warmup)
            outs += timer.outputs
        path = timer.path
        while eng.has_unfinished_requests():
            outs += eng.step()
        if i >= c.warmup:
            samples.append(first)
            cached.append(next(o.num_cached_tokens for o in outs
                               if o.request_id == f"host-prefill-{n}-{i}"))
    name = (f"prefill {n}" + (f" after {P}" if P else "")
            + (" new lengths" if c.new_lengths else ""))
    return HostTimeResult(name, path, _median_us(samples), len(samples), min(cached))


def time_decode(timer: HostTimer, vocab: int, b: int, c: HostTimeConfig) -> HostTimeResult:
    """Steady decode steps of b requests (after every one has prefilled)."""
    from mambaserve.engine.sampling_params import SamplingParams

    eng = timer.engine
    steps = c.warmup + c.repeats
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(vocab, b, 16, c.seed + 104729 * b)):
        eng.add_request(f"host-decode-{b}-{i}", {"prompt_token_ids": prompt}, params)
    while eng.scheduler.waiting or not all(r.prefill_done for r in eng.scheduler.running):
        eng.step()
    samples, path = [], ""
    for i in range(steps):
        s = timer.step()
        if s is not None and i >= c.warmup:
            samples.append(s)
            path = timer.path
    while eng.has_unfinished_requests():
        eng.step()
    if not samples:
        raise RuntimeError(f"decode {b}: no decode step launched a forward")
    return HostTimeResult(f"decode {b}", path, _median_us(samples), len(samples))


def run_host_time(c: HostTimeConfig, log=print) -> list[HostTimeResult]:
    from mambaserve.bench.presets import narrow_config, preset_config, write_config
    from mambaserve.config import EngineConfig
    from mambaserve.engine.llm_engine import LLMEngine

    c.validate()
    tmp = None
    load_format = c.engine.get("load_format", "auto")
    if c.preset is not None:
        cfg = preset_config(c.preset)
        if c.narrow:
            cfg = narrow_config(cfg)
        tmp = tempfile.TemporaryDirectory(prefix="mambaserve-host-")
        path, load_format = write_config(cfg, tmp.name), "dummy"
    else:
        path = Path(c.model)
    longest = max(c.input_lens, default=16)
    kw = {"dtype": c.dtype, "device": c.device, "load_format": load_format, "seed": c.seed,
          "max_num_seqs": max(c.decode_batches + [1]),
          "max_model_len": c.cached_prefix_len + max(longest, 16) + c.warmup + c.repeats + 32,
          "chunked_prefill_size": max(c.cached_prefix_len + longest,
                                      16 * max(c.decode_batches + [1])),
          "async_scheduling": True,
          **({"enable_prefix_caching": True} if c.cached_prefix_len else {}), **c.engine}
    results = []
    try:
        eng = LLMEngine(path, EngineConfig(**kw))
        vocab = eng.model_config.vocab_size
        timer = HostTimer(eng)
        if c.cprofile:
            timer.profile = cProfile.Profile()
        try:
            for n in c.input_lens:
                results.append(time_prefill(timer, vocab, n, c))
                log(format_result(results[-1]))
            if timer.profile is not None:  # before the decode scenarios (not profiled)
                log(profile_table(timer.profile, c.cprofile))
            for b in c.decode_batches:
                results.append(time_decode(timer, vocab, b, c))
                log(format_result(results[-1]))
        finally:
            timer.close()
            eng.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    return results


def profile_table(profile: cProfile.Profile, top: int) -> str:
    """The profiled prefixes' functions with the most own time, then the most time inside."""
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def format_result(r: HostTimeResult) -> str:
    phases = "  ".join(f"{p} {r.us[p]:7.1f}" for p in PHASES)
    hit = f", {r.cached_tokens} cached" if r.cached_tokens else ""
    return f"{r.scenario:<13} {r.path:<14} {phases}  (us, median of {r.steps}{hit})"


def add_args(p: argparse.ArgumentParser) -> None:
    from mambaserve.bench.one_batch import add_model_args

    add_model_args(p)
    p.add_argument("--narrow", action="store_true",
                   help="the preset's layers at tiny widths (a CPU can run it; host work per "
                        "step does not depend on the widths)")
    p.add_argument("--input-len", default="32,512", help="lone prompts of these lengths")
    p.add_argument("--decode-batch", default="1,8", help="steady decode steps of these batches")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per scenario")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of the same shape first")
    p.add_argument("--cached-prefix-len", type=int, default=0,
                   help="a follow-up turn: each lone prompt follows a history of this many "
                        "tokens, prefilled before (untimed) and served by the prefix cache")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="run the timed prefill steps' prefixes (from step() to the forward's "
                        "start) under cProfile and print its N functions with the most own "
                        "time and the N with the most time inside (the profiler slows the "
                        "host: phases measured with it are not comparable)")
    p.add_argument("--new-lengths", action="store_true",
                   help="prompt i of a scenario has N - i tokens: no lone-prompt template of "
                        "its length exists yet, as for a server's prompts of varied lengths")
    p.add_argument("--out", default=None, help="write the results as a JSON list")


def run_cli(a: argparse.Namespace) -> int:
    c = HostTimeConfig(model=a.model, preset=a.preset, narrow=a.narrow,
                       input_lens=int_list(a.input_len), decode_batches=int_list(a.decode_batch),
                       repeats=a.repeats, warmup=a.warmup, device=a.device, dtype=a.dtype,
                       engine=parse_settings(a.engine), seed=a.seed,
                       cached_prefix_len=a.cached_prefix_len, cprofile=a.cprofile,
                       new_lengths=a.new_lengths)
    results = run_host_time(c)
    if a.out:
        Path(a.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0
