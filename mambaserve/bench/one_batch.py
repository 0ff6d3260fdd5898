"""`mambaserve bench one-batch`: batches of B prompts of L tokens, O output tokens each,
measured in-process: time to first token of the batch (prefill latency) and prefill tokens/s,
per-step decode latency (median) and tokens/s, MFU of the prefill against a bf16 matmul ceiling
and decode bandwidth against a device-to-device copy ceiling, both measured at start.
`--batch-size` and `--input-len` take comma-separated sweeps; the model is loaded once.

    mambaserve bench one-batch --preset nemotron-nano-9b-v2 --device cuda --dtype bfloat16 \\
        --batch-size 1,2,4,8,16,32 --input-len 512,2048 --output-len 1
    mambaserve bench one-batch --preset tiny --batch-size 2 --input-len 32 --output-len 8  # CPU

`--preset` builds the real architecture with random weights drawn in the target dtype on the
device (`load_format="dummy"`: only config.json is written); `--save-reload DIR` instead writes a
full HF-format safetensors checkpoint into DIR and loads it back through the normal loader.
`--backend hf` runs the transformers class of the checkpoint's architecture on the same shapes
(its own random init). `--cached-prefix-len P` measures a follow-up turn: each prompt is P cached
tokens (prefilled once, untimed, with prefix caching on) followed by the L timed tokens, so TTFT is
the uncached suffix's.
Steps run without overlap scheduling (each step timed between device syncs) unless `--engine
async_scheduling=true`: then nothing syncs and a decode step's time is the interval between its
outputs, the inter-token latency a stream sees with the host running one step ahead.
The ceilings and the FLOP / byte counts behind MFU and the floors are in bench/roofline.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mambaserve.bench.one_batch_backends import HFBackend, MambaserveBackend
from mambaserve.bench.roofline import (
    ModelCounts,
    copy_ceiling,
    decode_step_bytes,
    decode_weight_bytes,
    matmul_ceiling,
    prefill_flops,
)
from mambaserve.config import resolve_device


@dataclass
class OneBatchConfig:
    model: str | None = None
    preset: str | None = None
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    input_lens: list[int] = field(default_factory=lambda: [128])
    output_len: int = 16
    backend: str = "mambaserve"
    device: str = "auto"  # cuda when torch sees a CUDA device, else cpu
    dtype: str = "bfloat16"
    save_reload: str | None = None
    warmup: int = 1
    repeats: int = 1  # timed runs per shape: TTFT is their median, decode steps pooled
    seed: int = 0
    engine: dict = field(default_factory=dict)  # extra EngineConfig fields
    cached_prefix_len: int = 0  # P tokens per prompt served from the prefix cache (0: none)
    temperature: float = 0.0  # 0: greedy; above: Gumbel-max sampling (the mambaserve backend)
    top_p: float = 1.0  # below 1: the sampled requests' nucleus filter

    def validate(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError("give exactly one of --model PATH or --preset NAME")
        if not self.batch_sizes or not self.input_lens:
            raise ValueError("give at least one batch size and one input length")
        if min(self.batch_sizes) < 1 or min(self.input_lens) < 1 or self.output_len < 1:
            raise ValueError("batch-size, input-len and output-len must be >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {self.repeats} "
                             f"and {self.warmup}")
        if self.backend not in ("mambaserve", "hf"):
            raise ValueError(f"unknown backend {self.backend!r}; use mambaserve or hf")
        if self.cached_prefix_len < 0:
            raise ValueError(f"--cached-prefix-len must be >= 0, got {self.cached_prefix_len}")
        if self.cached_prefix_len and self.backend != "mambaserve":
            raise ValueError("--cached-prefix-len needs the mambaserve backend (its prefix cache)")
        if self.temperature < 0 or (self.temperature and self.backend != "mambaserve"):
            raise ValueError(f"--temperature must be >= 0, and 0 (greedy) for the hf backend; "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1 or (self.top_p < 1 and not self.temperature):
            raise ValueError(f"--top-p must be in (0, 1], below 1 only with --temperature > 0; "
                             f"got {self.top_p}")
        if self.preset is not None:
            from mambaserve.bench.presets import preset_config

            preset_config(self.preset)  # an unknown name fails here, before the ceilings
        if self.model is not None and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model}: no config.json there (a Hugging Face "
                             f"checkpoint folder)")
        self.device = resolve_device(self.device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")


def int_list(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (the sweep flags)."""
    try:
        out = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise ValueError(f"expected comma-separated integers, got {text!r}")
    return out


# ---- settings strings ("key=value,...") shared with bench ab -------------------------------
def parse_settings(text: str | None) -> dict:
    """"enforce_eager=false,mamba_ssm_dtype=bfloat16" -> EngineConfig keyword arguments, values
    typed by the EngineConfig field (bool, int, float, str, None)."""
    from mambaserve.config import EngineConfig

    fields = EngineConfig.__dataclass_fields__
    out: dict = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        if "=" not in item:
            raise ValueError(f"setting {item!r} is not key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in fields:
            raise ValueError(f"unknown engine setting {key!r}; known: {sorted(fields)}")
        out[key] = _typed(key, value, str(fields[key].type))
    return out


def _typed(key: str, value: str, annotation: str):
    """`value` as the field's annotated type ("bool | None", "int", "float", "str | None", ...)."""
    kinds = {k.strip() for k in annotation.split("|")}
    if value.lower() in ("none", "null") and "None" in kinds:
        return None
    if "bool" in kinds:
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{key} takes true/false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    try:
        if "int" in kinds:
            return int(value)
        if "float" in kinds:
            return float(value)
    except ValueError:
        raise ValueError(f"{key} takes a number, got {value!r}") from None
    return value


@dataclass
class OneBatchResult:
    backend: str
    device: str
    dtype: str
    batch_size: int
    input_len: int
    output_len: int
    params: int
    prefill_s: float  # time to first token of the whole batch (TTFT; median of the repeats)
    prefill_tokens_per_s: float
    prefill_flops: float
    prefill_mfu: float
    prefill_floor_s: float  # prefill_flops / matmul ceiling
    decode_step_s: float  # median
    decode_tokens_per_s: float
    decode_steps: list[float]
    decode_bytes_per_step: int
    decode_floor_s: float  # decode bytes / copy ceiling
    decode_bandwidth: float  # bytes/s
    decode_bandwidth_fraction: float
    matmul_ceiling_flops: float
    copy_ceiling_bytes_per_s: float
    load_s: float = 0.0
    active_params: float = 0.0  # parameters a token multiplies (MoE: its k experts, not all E)
    fp8_params: int = 0  # weights stored as float8 (1 byte each in the decode floor)
    temperature: float = 0.0  # the requests' (0: greedy)
    top_p: float = 1.0
    cached_prefix_len: int = 0  # tokens before input_len per prompt, from the prefix cache
    cached_tokens: list[int] = field(default_factory=list)  # per prompt: what the cache served
    prefill_runs: list[float] = field(default_factory=list)  # each timed run's TTFT
    note: str = ""
    error: str = ""


def run_one_batch(c: OneBatchConfig, log=print) -> list[OneBatchResult]:
    """One result per (input length, batch size) of the sweep; the model is loaded once."""
    from mambaserve.bench.presets import materialize_preset
    from mambaserve.config import ModelConfig, resolve_dtype

    c.validate()
    device = torch.device(c.device)
    dtype = resolve_dtype(c.dtype)
    note = "" if device.type == "cuda" else (
        "CPU run: ceilings measured on small sizes (512^3 matmul, 64 MiB copy); figures are a "
        "smoke test")
    mm = matmul_ceiling(device, dtype)
    cp = copy_ceiling(device)
    log(f"ceilings: {mm['dtype']} matmul {mm['n']}^3 {mm['flops'] / 1e12:.2f} TFLOP/s, "
        f"copy {cp['bytes_per_s'] / 1e9:.1f} GB/s (read + write)" + (f"  [{note}]" if note else ""))

    tmp = None
    load_format = c.engine.pop("load_format", "auto")
    if c.preset:
        t0 = time.perf_counter()
        path, load_format, tmp = materialize_preset(c.preset, c.save_reload, dtype=dtype,
                                                    device=device, seed=c.seed)
        if c.save_reload:
            log(f"preset {c.preset}: random {str(dtype).removeprefix('torch.')} checkpoint "
                f"written to {path} in {time.perf_counter() - t0:.1f} s")
    else:
        path = Path(c.model)
    results = []
    try:
        cfg_dict = json.loads((path / "config.json").read_text())
        counts = ModelCounts.of(cfg_dict)
        mcfg = ModelConfig.from_dict(cfg_dict)
        backend = (MambaserveBackend if c.backend == "mambaserve" else HFBackend)(
            path, c, load_format)
        log(f"{c.backend}: model ready in {backend.load_s:.1f} s ({load_format} weights)")
        ssm_dtype = resolve_dtype(c.engine.get("mamba_ssm_dtype", "float32"))
        for n in c.input_lens:
            for b in c.batch_sizes:
                # prompts of their own per shape: with the prefix cache on, a prompt must not
                # begin with an earlier shape's (one seed for all would make each a prefix hit)
                seed = c.seed + 7919 * n + 104729 * b
                for w in range(c.warmup):  # compile / autotune / capture on the same shapes
                    try:
                        backend.run(b, n, min(c.output_len, 3), seed + 1000 + w)
                    except torch.OutOfMemoryError:
                        break
                runs, steps, error = [], [], ""
                try:
                    for r in range(c.repeats):  # fresh prompts per repeat (no prefix hits)
                        ttft, run_steps = backend.run(b, n, c.output_len, seed + 7 * r)
                        runs.append(ttft)
                        steps += run_steps
                except torch.OutOfMemoryError as e:
                    runs, steps, error = [], [], f"out of memory: {e}"[:200]
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                prefill_s = statistics.median(runs) if runs else float("nan")
                flops = prefill_flops(mcfg, counts, b, n)
                step = statistics.median(steps) if steps else float("nan")
                fp8 = getattr(backend, "fp8_params", 0)
                weight_bytes = decode_weight_bytes(counts, mcfg, b, dtype, fp8)
                step_bytes = decode_step_bytes(mcfg, weight_bytes, b, c.cached_prefix_len + n
                                               + c.output_len // 2, dtype, ssm_dtype)
                bw = step_bytes / step if steps else float("nan")
                r = OneBatchResult(
                    backend=c.backend, device=str(device), dtype=str(dtype).removeprefix("torch."),
                    batch_size=b, input_len=n, output_len=c.output_len, params=counts.params,
                    prefill_s=prefill_s, prefill_tokens_per_s=b * n / prefill_s,
                    prefill_flops=flops, prefill_mfu=flops / prefill_s / mm["flops"],
                    prefill_floor_s=flops / mm["flops"], decode_step_s=step,
                    decode_tokens_per_s=b / step if steps else float("nan"),
                    decode_steps=steps, decode_bytes_per_step=step_bytes,
                    decode_floor_s=step_bytes / cp["bytes_per_s"], decode_bandwidth=bw,
                    decode_bandwidth_fraction=bw / cp["bytes_per_s"],
                    matmul_ceiling_flops=mm["flops"], copy_ceiling_bytes_per_s=cp["bytes_per_s"],
                    load_s=backend.load_s, active_params=counts.per_token + counts.lm_head,
                    fp8_params=fp8, cached_prefix_len=c.cached_prefix_len,
                    temperature=c.temperature, top_p=c.top_p,
                    cached_tokens=list(getattr(backend, "cached_tokens", [])),
                    prefill_runs=runs, note=note, error=error)
                log(format_result(r))
                results.append(r)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return results


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def format_result(r: OneBatchResult) -> str:
    active = (f" ({_count(int(r.active_params))} active per token)"
              if r.active_params and r.active_params < 0.9 * r.params else "")
    head = (f"backend {r.backend} on {r.device} ({r.dtype}), {_count(r.params)} params{active}, "
            f"batch {r.batch_size} x input {r.input_len}, output {r.output_len}"
            + (f", FP8 weights {_count(r.fp8_params)}" if r.fp8_params else "")
            + (f", sampling at temperature {r.temperature:g}" if r.temperature else "")
            + (f", top_p {r.top_p:g}" if r.top_p < 1 else "")
            + (f", after a cached prefix of {r.cached_prefix_len} (cache served "
               f"{min(r.cached_tokens, default=0)}..{max(r.cached_tokens, default=0)} tokens)"
               if r.cached_prefix_len else ""))
    if r.error:
        return f"{head}\nerror: {r.error}"
    spread = (f", median of {len(r.prefill_runs)}: {min(r.prefill_runs) * 1e3:.2f}.."
              f"{max(r.prefill_runs) * 1e3:.2f}" if len(r.prefill_runs) > 1 else "")
    lines = [head, (
        f"prefill: {r.prefill_s * 1e3:.2f} ms (TTFT{spread}), {r.prefill_tokens_per_s:,.0f} "
        f"tokens/s, "
        f"MFU {100 * r.prefill_mfu:.1f} % of {r.matmul_ceiling_flops / 1e12:.2f} TFLOP/s "
        f"({r.prefill_flops / 1e12:.2f} TFLOP; floor {r.prefill_floor_s * 1e3:.2f} ms, "
        f"{r.prefill_s / r.prefill_floor_s:.2f}x)")]
    if r.decode_steps:
        lines.append(
            f"decode:  {r.decode_step_s * 1e3:.2f} ms/step (median of {len(r.decode_steps)}), "
            f"{r.decode_tokens_per_s:,.1f} tokens/s, {r.decode_bandwidth / 1e9:.1f} GB/s = "
            f"{100 * r.decode_bandwidth_fraction:.1f} % of "
            f"{r.copy_ceiling_bytes_per_s / 1e9:.1f} GB/s "
            f"({r.decode_bytes_per_step / 1e9:.3f} GB per step: weights + state read/write + KV; "
            f"floor {r.decode_floor_s * 1e3:.2f} ms, {r.decode_step_s / r.decode_floor_s:.2f}x)")
    if r.note:
        lines.append(f"note: {r.note}")
    return "\n".join(lines)


def format_table(results: list[OneBatchResult]) -> str:
    """A markdown table of a sweep, one row per (input length, batch size)."""
    out = [("| backend | batch | input | TTFT ms | prefill tok/s | MFU % | x floor "
            "| decode ms/step | decode tok/s | % of BW floor |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            out.append(f"| {r.backend} | {r.batch_size} | {r.input_len} | {r.error[:40]} |"
                       " | | | | | |")
            continue
        dec = (f"{r.decode_step_s * 1e3:.2f} | {r.decode_tokens_per_s:,.0f} | "
               f"{100 * r.decode_floor_s / r.decode_step_s:.0f}") if r.decode_steps else "- | - | -"
        out.append(f"| {r.backend} | {r.batch_size} | {r.input_len} | {r.prefill_s * 1e3:.1f} | "
                   f"{r.prefill_tokens_per_s:,.0f} | {100 * r.prefill_mfu:.1f} | "
                   f"{r.prefill_s / r.prefill_floor_s:.2f} | {dec} |")
    return "\n".join(out)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model | --preset, --device, --dtype, --engine, --seed: shared with `bench profile`."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", default=None, help="HF checkpoint folder")
    src.add_argument("--preset", default=None, help="nemotron-nano-9b-v2 | tiny (random weights)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N; auto: cuda when torch sees a CUDA device")
    p.add_argument("--dtype", default="bfloat16", help="weights and activations")
    p.add_argument("--engine", default="", metavar="K=V,...",
                   help="extra EngineConfig settings, e.g. enforce_eager=false")
    p.add_argument("--seed", type=int, default=0, help="prompts and random weights")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--batch-size", default="1", help="one or a comma-separated sweep: 1,8,32")
    p.add_argument("--input-len", default="128", help="one or a comma-separated sweep: 512,2048")
    p.add_argument("--output-len", type=int, default=16,
                   help="1 measures prefill only (no decode steps)")
    p.add_argument("--backend", default="mambaserve", choices=["mambaserve", "hf"],
                   help="hf: the transformers class of the architecture on the same shapes")
    p.add_argument("--save-reload", default=None, metavar="DIR",
                   help="write the preset as a full safetensors checkpoint into DIR and load it "
                        "back (the load path at scale); default: random weights drawn on the "
                        "device at load, no checkpoint on disk")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs on the same shapes")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per shape, each on fresh prompts: the TTFT reported is their "
                        "median (all runs listed in --out's prefill_runs), decode steps pooled")
    p.add_argument("--cached-prefix-len", type=int, default=0, metavar="P",
                   help="a follow-up turn: each prompt starts with P tokens prefilled before "
                        "(untimed) and served by the prefix cache, then --input-len timed tokens")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy decoding; above 0: every request samples at this temperature "
                        "(the sampler's Gumbel-max path; mambaserve backend)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="with --temperature: the requests' top_p (below 1: the sampler's filters)")
    p.add_argument("--out", default=None, help="write the results as a JSON list")


def run_cli(a: argparse.Namespace) -> int:
    """`mambaserve bench one-batch`; a bad setting is a ValueError (one line from the CLI)."""
    c = OneBatchConfig(model=a.model, preset=a.preset, batch_sizes=int_list(a.batch_size),
                       input_lens=int_list(a.input_len), output_len=a.output_len,
                       backend=a.backend, device=a.device, dtype=a.dtype,
                       save_reload=a.save_reload, warmup=a.warmup, repeats=a.repeats,
                       seed=a.seed,
                       engine=parse_settings(a.engine), cached_prefix_len=a.cached_prefix_len,
                       temperature=a.temperature, top_p=a.top_p)
    results = run_one_batch(c)
    print(format_table(results))
    if a.out:
        Path(a.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0
