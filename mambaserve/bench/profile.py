"""`mambaserve bench profile`: where the time of a prefill step and of a decode step goes.

One batch of B prompts of L tokens runs through the engine under `torch.profiler`: first the
prefill (every step until each prompt has its first token), then `--steps` decode steps, then
(with `--mixed-len M`) the mixed steps of one new M-token prompt prefilled while the batch keeps
decoding (the serving case: its chunks capped by `max_step_prefill_tokens`). With
`--cached-prefix-len P` each prompt follows a P-token history prefilled first (unprofiled), so
the prefill phase is a follow-up turn's: a prefix-cache hit and the uncached suffix. The
device time of every kernel is summed by name and grouped (matmul, SSD scan, conv, attention,
norm, state update, copies, elementwise, communication: the tensor-parallel collectives, other);
the report gives each group's share of the step, how busy the device was during the step (busy /
wall: the rest is host time the device waited for), the matmuls' achieved TFLOP/s against the
matmul ceiling (prefill) and their achieved bandwidth against the copy ceiling (decode). This is
the evidence docs/benchmarks.md cites for what bounds a missed target.

    mambaserve bench profile --preset nemotron-nano-9b-v2 --device cuda --batch-size 8 \\
        --input-len 2048 --steps 8 --engine enforce_eager=false --out prof.json

On CUDA the kernel times come from the profiler's trace (CUPTI: kernels replayed inside a CUDA
graph are seen too); on the CPU (smoke test) from the operators' self CPU time. `--by-grid` times
each CUDA kernel per launch grid, so the launches of one kernel at different shapes (each
projection of a decode step through the few-rows linear) get a row each. With programmatic
dependent launch on (the default on Hopper, ops/triton/_common.py) a kernel starts before the one
it follows has finished and its time includes that wait: per-kernel times then overlap and add up
to more than the busy time; `MAMBASERVE_PDL=0` gives each kernel's own time. The device's idle
time within the phase (before its first kernel, after its last, between) is `trace_idle`'s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mambaserve.bench.one_batch import (
    ModelCounts,
    OneBatchConfig,
    add_model_args,
    copy_ceiling,
    matmul_ceiling,
    parse_settings,
)
from mambaserve.bench.one_batch_backends import (
    MambaserveBackend,
    prefill_untimed,
    random_prompts,
)
from mambaserve.bench.roofline import sync

# (group, substrings of a kernel / operator name), first match wins; names are lower-cased.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # tensor parallelism's collectives (NCCL kernels, c10d operators): the all-reduce share
    ("communication", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "c10d")),
    ("ssd", ("_chunk_", "state_passing", "ssd")),
    ("conv", ("conv",)),
    ("state_update", ("_ssu_", "selective_state")),
    ("attention", ("attention", "flash", "fmha", "sdpa", "write_kv", "rotary")),
    ("norm", ("rmsnorm", "norm")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear", "aten::matmul", "splitk", "gemv", "scaled_mm")),
    ("copy", ("memcpy", "memset", "copy", "aten::cat", "index", "gather", "scatter", "fill")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "aten::", "triton_",
                     "silu", "relu")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


@dataclass
class PhaseProfile:
    phase: str  # "prefill", "decode" or "mixed"
    steps: int  # engine steps profiled
    wall_s: float  # host wall time of those steps (synchronized)
    device_busy_s: float  # union of kernel intervals (CUDA) or summed self time (CPU)
    groups: dict[str, float]  # group -> seconds
    top: list[tuple[str, float, int]]  # (name, seconds, calls), longest first
    matmul_flops: float = 0.0  # prefill: the weight matmuls' FLOPs
    matmul_bytes: float = 0.0  # decode: the weights the matmuls read
    notes: list[str] = field(default_factory=list)
    # CUDA: where the device waited within the phase (`trace_idle`); empty on the CPU
    idle: dict = field(default_factory=dict)


def trace_kernel_times(events: list[dict], by_grid: bool = False
                       ) -> tuple[dict[str, list[float]], float]:
    """From a CUDA chrome trace's events: {name: [total seconds, calls]} of the device's
    kernels, copies and memsets, and the busy time (union of their intervals). `by_grid`: a
    kernel's name carries its launch grid ("NAME grid XxYxZ"), so that the launches of one kernel
    at different shapes or launch settings (each projection of a decode step) are timed apart;
    launches of equal grids still share a row (e.g. two projections of the same N and block)."""
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    spans = []
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            name = e["name"]
            grid = (e.get("args") or {}).get("grid")
            if by_grid and e.get("cat") == "kernel" and grid:
                name = f"{name} grid {'x'.join(str(g) for g in grid)}"
            t = times[name]
            t[0] += e["dur"] * 1e-6
            t[1] += 1
            spans.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return dict(times), busy * 1e-6


PHASE_MARK = "mambaserve_profiled_phase"  # the host range `_profiled` wraps the steps in


def trace_idle(events: list[dict], largest: int = 5) -> dict:
    """Where the device waited for the host within the `PHASE_MARK` range of a CUDA chrome
    trace: before its first kernel (the step's host preparation), after its last (the host's
    end of step: sampling, outputs), and in the gaps between kernels, with the `largest` gaps
    and the kernels on either side of each. Seconds; {} without the mark or device events."""
    mark = [e for e in events if e.get("name") == PHASE_MARK and "dur" in e
            and e.get("cat") != "gpu_user_annotation"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e)
    if not mark or not spans:
        return {}
    start, stop = float(mark[0]["ts"]), float(mark[0]["ts"]) + float(mark[0]["dur"])
    gaps = []  # (seconds, at seconds after the start, before, after)
    end, last = spans[0][1], spans[0][2]
    for a, b, name in spans[1:]:
        if a > end:
            gaps.append(((a - end) * 1e-6, (end - start) * 1e-6, last, name))
        if b >= end:
            end, last = b, name
    gaps.sort(key=lambda g: -g[0])
    return {"before_first_s": max(0.0, spans[0][0] - start) * 1e-6,
            "after_last_s": max(0.0, stop - end) * 1e-6,
            "between_s": sum(g[0] for g in gaps), "gaps": len(gaps),
            "largest": [{"s": g[0], "at_s": g[1], "after": g[2], "before": g[3]}
                        for g in gaps[:largest]]}


def _trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()).get("traceEvents", [])


def _kernel_times(prof, device: torch.device, by_grid: bool = False
                  ) -> tuple[dict[str, list[float]], float, dict]:
    """{name: [total seconds, calls]}, the busy time and where the device idled (CUDA:
    `trace_kernel_times`, `trace_idle`; CPU: the operators' self time, by name only, no idle)."""
    if device.type == "cuda":
        events = _trace_events(prof)
        return (*trace_kernel_times(events, by_grid), trace_idle(events))
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.self_cpu_time_total > 0:
            t = times[e.key]
            t[0] += e.self_cpu_time_total * 1e-6
            t[1] += e.count
    return dict(times), sum(t[0] for t in times.values()), {}


def _profiled(fn, device: torch.device):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        sync(device)
        t0 = time.perf_counter()
        with torch.profiler.record_function(PHASE_MARK):
            steps = fn()
            sync(device)
        wall = time.perf_counter() - t0
    return prof, wall, steps


def _phase(name: str, prof, wall: float, steps: int, device: torch.device, top: int,
           by_grid: bool = False, **extra) -> PhaseProfile:
    times, busy, idle = _kernel_times(prof, device, by_grid)
    groups: dict[str, float] = defaultdict(float)
    for k, (s, _) in times.items():
        groups[group_of(k)] += s
    ranked = sorted(((k, s, int(c)) for k, (s, c) in times.items()), key=lambda r: -r[1])
    return PhaseProfile(name, steps, wall, busy, dict(groups), ranked[:top], idle=idle, **extra)


def profile_batch(c: OneBatchConfig, decode_steps: int = 8, top: int = 15,
                  log=print, mixed_len: int = 0, by_grid: bool = False) -> list[PhaseProfile]:
    """Profile the prefill of one batch, `decode_steps` decode steps after it and, when
    `mixed_len` > 0, the steps that prefill one more prompt of that length beside the decodes.
    `by_grid`: CUDA kernels timed per launch grid (`trace_kernel_times`)."""
    from mambaserve.bench.presets import materialize_preset
    from mambaserve.config import ModelConfig, resolve_dtype
    from mambaserve.engine.sampling_params import SamplingParams

    c.validate()
    if len(c.batch_sizes) != 1 or len(c.input_lens) != 1:
        raise ValueError("bench profile takes one batch size and one input length")
    if decode_steps < 1:
        raise ValueError("--steps must be >= 1")
    if mixed_len < 0:
        raise ValueError("--mixed-len must be >= 0")
    b, n = c.batch_sizes[0], c.input_lens[0]
    device, dtype = torch.device(c.device), resolve_dtype(c.dtype)
    # the batch keeps decoding through the mixed phase (a prompt of M tokens takes at most M
    # steps, one token each at the smallest cap)
    c.output_len = max(c.output_len, decode_steps + 2 + (mixed_len + 2 if mixed_len else 0))
    if mixed_len:
        c.input_lens = [max(n, mixed_len)]  # the engine's max_model_len covers both
        c.engine.setdefault("max_num_seqs", b + 1)  # room for the new prompt beside the batch
    load_format = c.engine.pop("load_format", "auto")
    tmp = None
    if c.preset:
        path, load_format, tmp = materialize_preset(c.preset, None, dtype=dtype, device=device,
                                                    seed=c.seed)
    else:
        path = Path(c.model)
    try:
        cfg_dict = json.loads((path / "config.json").read_text())
        counts = ModelCounts.of(cfg_dict)
        cfg = ModelConfig.from_dict(cfg_dict)
        backend = MambaserveBackend(path, c, load_format)
        for w in range(c.warmup):  # compile, autotune, capture the graphs on the same shapes
            backend.run(b, n, decode_steps + 2, c.seed + 1000 + w)
        eng = backend.engine
        params = SamplingParams(temperature=0, max_tokens=c.output_len, ignore_eos=True)
        prompts = random_prompts(cfg.vocab_size, b, n, c.seed)
        if c.cached_prefix_len:  # a follow-up turn: the histories first, untimed, unprofiled
            histories = random_prompts(cfg.vocab_size, b, c.cached_prefix_len, c.seed + 7919)
            backend.counter += 1
            prefill_untimed(eng, histories, f"h{backend.counter}")
            prompts = [h + q for h, q in zip(histories, prompts)]
        ids = []
        for prompt in prompts:
            backend.counter += 1
            ids.append(f"p{backend.counter}")
            eng.add_request(ids[-1], {"prompt_token_ids": prompt}, params)

        cached: dict[str, int] = {}

        def prefill() -> int:
            started: set[str] = set()
            steps = 0
            while len(started) < b:
                outs = eng.step()
                steps += 1
                started.update(o.request_id for o in outs if o.outputs[0].token_ids)
                cached.update((o.request_id, o.num_cached_tokens) for o in outs)
            return steps

        def decode() -> int:
            for _ in range(decode_steps):
                eng.step()
            return decode_steps

        prof, wall, steps = _profiled(prefill, device)
        pre = _phase("prefill", prof, wall, steps, device, top, by_grid,
                     matmul_flops=2.0 * (counts.per_token * b * n + counts.lm_head * b))
        if c.cached_prefix_len:
            pre.notes.append(f"after a {c.cached_prefix_len}-token history: the prefix cache "
                             f"served {min(cached.values(), default=0)}.."
                             f"{max(cached.values(), default=0)} tokens per prompt")
        prof, wall, steps = _profiled(decode, device)
        weight_bytes = (counts.params - counts.embedding) * dtype.itemsize
        dec = _phase("decode", prof, wall, steps, device, top, by_grid,
                     matmul_bytes=float(weight_bytes))
        phases = [pre, dec]
        if mixed_len:
            new = f"m{backend.counter + 1}"
            backend.counter += 1
            prompt = random_prompts(cfg.vocab_size, 1, mixed_len, c.seed + 7)[0]
            eng.add_request(new, {"prompt_token_ids": prompt},
                            SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))

            def mixed() -> int:
                steps = 0
                while True:
                    outs = eng.step()
                    steps += 1
                    if any(o.request_id == new and o.outputs[0].token_ids for o in outs):
                        return steps

            prof, wall, steps = _profiled(mixed, device)
            phases.append(_phase("mixed", prof, wall, steps, device, top, by_grid))
            phases[-1].notes.append(f"one {mixed_len}-token prompt prefilled beside {b} decoding "
                                    f"rows in {steps} step(s)")
        while eng.has_unfinished_requests():
            eng.step()
        mm, cp = matmul_ceiling(device, dtype), copy_ceiling(device)
        for p in (pre, dec):
            mat = p.groups.get("matmul", 0.0)
            if p.matmul_flops and mat:
                p.notes.append(f"matmuls: {p.matmul_flops / mat / 1e12:.1f} TFLOP/s = "
                               f"{100 * p.matmul_flops / mat / mm['flops']:.0f} % of the "
                               f"{mm['flops'] / 1e12:.0f} TFLOP/s matmul ceiling")
            if p.matmul_bytes and mat:
                per_step = mat / p.steps
                p.notes.append(f"matmuls: {p.matmul_bytes / per_step / 1e9:.0f} GB/s of weights "
                               f"= {100 * p.matmul_bytes / per_step / cp['bytes_per_s']:.0f} % "
                               f"of the {cp['bytes_per_s'] / 1e9:.0f} GB/s copy ceiling")
        log(f"profile: batch {b} x input {n} on {device} ({c.dtype}), engine {c.engine or '{}'}")
        for p in phases:
            log(format_phase(p))
        return phases
    finally:
        if tmp is not None:
            tmp.cleanup()


def format_phase(p: PhaseProfile) -> str:
    per = 1e3 / p.steps
    lines = [(f"{p.phase}: {p.steps} step(s), {p.wall_s * per:.3f} ms/step wall, device busy "
              f"{p.device_busy_s * per:.3f} ms/step ({100 * p.device_busy_s / p.wall_s:.0f} %)"),
             "| group | ms/step | % of busy |", "|---|---|---|"]
    total = sum(p.groups.values()) or 1.0
    for g, s in sorted(p.groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {g} | {s * per:.3f} | {100 * s / total:.1f} |")
    lines += ["| kernel | group | ms/step | calls/step |", "|---|---|---|---|"]
    for name, s, calls in p.top:
        short = name if len(name) < 70 else name[:67] + "..."
        lines.append(f"| `{short}` | {group_of(name)} | {s * per:.3f} | {calls / p.steps:g} |")
    lines += p.notes
    if p.idle:
        i = p.idle
        lines.append(f"device idle per step: {i['before_first_s'] * per:.3f} ms before the first "
                     f"kernel, {i['after_last_s'] * per:.3f} ms after the last, "
                     f"{i['between_s'] * per:.3f} ms in {i['gaps'] / p.steps:g} gaps between")
        for g in i["largest"]:
            lines.append(f"  gap {g['s'] * 1e3:.3f} ms at {g['at_s'] * 1e3:.3f} ms: after "
                         f"`{g['after'][:50]}`, before `{g['before'][:50]}`")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--batch-size", type=int, default=1, help="prompts in the batch")
    p.add_argument("--input-len", type=int, default=512, help="tokens per prompt")
    p.add_argument("--steps", type=int, default=8, help="decode steps profiled after the prefill")
    p.add_argument("--cached-prefix-len", type=int, default=0,
                   help="a follow-up turn: each prompt is this many tokens served from the prefix "
                        "cache (prefilled before, unprofiled), then the profiled input")
    p.add_argument("--mixed-len", type=int, default=0,
                   help="also profile the steps that prefill one prompt of this many tokens "
                        "while the batch decodes (0: skip)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs on the same shapes")
    p.add_argument("--top", type=int, default=15, help="kernels listed per phase")
    p.add_argument("--by-grid", action="store_true",
                   help="time each CUDA kernel per launch grid (e.g. every projection of a "
                        "decode step apart)")
    p.add_argument("--out", default=None, help="write the phases as JSON")


def run_cli(a: argparse.Namespace) -> int:
    """`mambaserve bench profile`; a bad setting is a ValueError (one line from the CLI)."""
    c = OneBatchConfig(model=a.model, preset=a.preset, batch_sizes=[a.batch_size],
                       input_lens=[a.input_len], device=a.device, dtype=a.dtype,
                       warmup=a.warmup, seed=a.seed, engine=parse_settings(a.engine),
                       cached_prefix_len=a.cached_prefix_len)
    phases = profile_batch(c, decode_steps=a.steps, top=a.top, mixed_len=a.mixed_len,
                           by_grid=a.by_grid)
    if a.out:
        Path(a.out).write_text(json.dumps([asdict(p) for p in phases], indent=1))
    return 0
