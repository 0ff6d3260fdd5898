"""`mambaserve bench one-batch`: one batch of B prompts of L tokens, O output tokens, measured
in-process: prefill latency and tokens/s, per-step decode latency (median) and tokens/s, MFU of
the prefill against a measured bf16 matmul ceiling, achieved bandwidth of a decode step against
a measured device-to-device copy ceiling.

    mambaserve bench one-batch --preset nemotron-nano-9b-v2 --device cuda --dtype bfloat16 \\
        --batch-size 8 --input-len 2048 --output-len 64
    mambaserve bench one-batch --preset tiny --batch-size 2 --input-len 32 --output-len 8  # CPU

`--preset` writes an HF-format checkpoint (random weights drawn in the target dtype on the
target device) into `--save-reload DIR` (default: a temporary folder) and loads it back through
the normal loader. `--backend hf` runs transformers' NemotronHForCausalLM on the same shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class OneBatchConfig:
    model: str | None = None
    preset: str | None = None
    batch_size: int = 1
    input_len: int = 128
    output_len: int = 16
    backend: str = "mambaserve"
    device: str = "cpu"
    dtype: str = "bfloat16"
    save_reload: str | None = None
    warmup: int = 1
    seed: int = 0
    engine: dict = field(default_factory=dict)  # extra EngineConfig fields

    def validate(self) -> None:
        if (self.model is None) == (self.preset is None):
            raise ValueError("give exactly one of --model PATH or --preset NAME")
        if self.batch_size < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("batch-size, input-len and output-len must be >= 1")
        if self.backend not in ("mambaserve", "hf"):
            raise ValueError(f"unknown backend {self.backend!r}; use mambaserve or hf")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no CUDA device")


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
        default = getattr(EngineConfig(), key)
        out[key] = _typed(key, value, default)
    return out


def _typed(key: str, value: str, default):
    if value.lower() in ("none", "null"):
        return None
    if isinstance(default, bool):
        if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{key} takes true/false, got {value!r}")
        return value.lower() in ("true", "1", "yes")
    if isinstance(default, int) or key in ("max_model_len", "memory_budget_bytes",
                                           "mamba_snapshot_interval"):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value


# ---- ceilings ------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device, iters: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_ceiling(device: torch.device, dtype: torch.dtype, n: int | None = None) -> dict:
    """FLOP/s of an n^3 matmul (8192 on CUDA, 512 on a CPU), best of a few."""
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = _best_time(lambda: torch.matmul(a, b), device, 10 if device.type == "cuda" else 3)
    return {"flops": 2 * n ** 3 / t, "n": n, "dtype": str(dtype).removeprefix("torch.")}


def copy_ceiling(device: torch.device, nbytes: int | None = None) -> dict:
    """Bytes/s (read + written) of a device-to-device copy (1 GiB on CUDA, 64 MiB on a CPU)."""
    nbytes = nbytes or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = _best_time(lambda: dst.copy_(src), device, 10 if device.type == "cuda" else 3)
    return {"bytes_per_s": 2 * nbytes / t, "bytes": nbytes}


# ---- derived figures ----------------------------------------------------------------------
def decode_step_bytes(cfg, weight_bytes: int, batch_size: int, context_len: int,
                      dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """Bytes a decode step must move: every weight once, each row's Mamba state read and
    written, each row's cached K/V read."""
    from mambaserve.cache.kv_pool import KVPool
    from mambaserve.cache.state_pool import StatePool

    state = StatePool.bytes_per_slot(cfg, dtype, ssm_dtype) * batch_size * 2
    kv_per_token = KVPool.bytes_per_page(cfg, 1, dtype)
    return weight_bytes + state + batch_size * context_len * kv_per_token


@dataclass
class OneBatchResult:
    backend: str
    device: str
    dtype: str
    batch_size: int
    input_len: int
    output_len: int
    params: int
    prefill_s: float
    prefill_tokens_per_s: float
    decode_step_s: float  # median
    decode_tokens_per_s: float
    decode_steps: list[float]
    matmul_ceiling_flops: float
    copy_ceiling_bytes_per_s: float
    prefill_mfu: float
    decode_bytes_per_step: int
    decode_bandwidth: float  # bytes/s
    decode_bandwidth_fraction: float
    load_s: float = 0.0
    note: str = ""


def _prompts(cfg_vocab: int, b: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg_vocab, (b, n), generator=g).tolist()


def _run_mambaserve(path: Path, c: OneBatchConfig) -> tuple[float, list[float], object, float]:
    from mambaserve.config import EngineConfig
    from mambaserve.engine.llm_engine import LLMEngine
    from mambaserve.engine.sampling_params import SamplingParams

    kw = {"dtype": c.dtype, "device": c.device, "max_num_seqs": c.batch_size,
          "chunked_prefill_size": c.batch_size * c.input_len,
          "max_model_len": c.input_len + c.output_len + 16, **c.engine}
    t0 = time.perf_counter()
    eng = LLMEngine(path, EngineConfig(**kw))
    load_s = time.perf_counter() - t0
    device = eng.device
    params = SamplingParams(temperature=0, max_tokens=c.output_len, ignore_eos=True)

    def one(seed: int, out_len: int) -> tuple[float, list[float]]:
        p = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        for i, ids in enumerate(_prompts(eng.model_config.vocab_size, c.batch_size, c.input_len,
                                         seed)):
            eng.add_request(f"s{seed}-{i}", {"prompt_token_ids": ids}, p)
        times = []
        while eng.has_unfinished_requests():
            _sync(device)
            t = time.perf_counter()
            eng.step()
            _sync(device)
            times.append(time.perf_counter() - t)
        return times[0], times[1:]

    for w in range(c.warmup):  # compile / autotune / capture on the same shapes
        one(c.seed + 1000 + w, min(c.output_len, 3))
    prefill_s, steps = one(c.seed, params.max_tokens)
    return prefill_s, steps, eng.model_config, load_s


def _run_hf(path: Path, c: OneBatchConfig) -> tuple[float, list[float], object, float]:
    from transformers import LogitsProcessor, LogitsProcessorList, NemotronHForCausalLM

    from mambaserve.config import ModelConfig, resolve_dtype

    cfg = ModelConfig.from_hf(path)
    device = torch.device(c.device)
    t0 = time.perf_counter()
    model = NemotronHForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(c.dtype, cfg, device.type)).to(device).eval()
    load_s = time.perf_counter() - t0

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, input_ids, scores):
            _sync(device)
            self.t.append(time.perf_counter())
            return scores

    def one(seed: int, out_len: int) -> tuple[float, list[float]]:
        ids = torch.tensor(_prompts(cfg.vocab_size, c.batch_size, c.input_len, seed),
                           device=device)
        with torch.inference_mode():
            _sync(device)
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)  # a single prefill forward
            _sync(device)
            prefill = time.perf_counter() - t
            stamp = Stamp()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                           min_new_tokens=out_len, do_sample=False,
                           logits_processor=LogitsProcessorList([stamp]),
                           pad_token_id=cfg.pad_token_id or 0)
        return prefill, [b - a for a, b in zip(stamp.t, stamp.t[1:])]

    for w in range(c.warmup):
        one(c.seed + 1000 + w, min(c.output_len, 3))
    prefill_s, steps = one(c.seed, c.output_len)
    return prefill_s, steps, cfg, load_s


def run_one_batch(c: OneBatchConfig, log=print) -> OneBatchResult:
    from mambaserve.bench.presets import param_count, preset_config, write_checkpoint
    from mambaserve.config import ModelConfig, resolve_dtype

    c.validate()
    device = torch.device(c.device)
    dtype = resolve_dtype(c.dtype)
    note = "" if device.type == "cuda" else \
        "CPU run: ceilings measured on small sizes (512^3 matmul, 64 MiB copy); figures are a smoke test"
    mm = matmul_ceiling(device, dtype)
    cp = copy_ceiling(device)
    log(f"ceilings: {mm['dtype']} matmul {mm['n']}^3 {mm['flops'] / 1e12:.2f} TFLOP/s, "
        f"copy {cp['bytes_per_s'] / 1e9:.1f} GB/s (read + write)" + (f"  [{note}]" if note else ""))

    tmp = None
    if c.preset:
        if c.save_reload:
            path = Path(c.save_reload)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="mambaserve-preset-")
            path = Path(tmp.name)
        t0 = time.perf_counter()
        write_checkpoint(preset_config(c.preset), path, dtype=dtype, device=device, seed=c.seed)
        log(f"preset {c.preset}: random {str(dtype).removeprefix('torch.')} checkpoint written to {path} in "
            f"{time.perf_counter() - t0:.1f} s")
    else:
        path = Path(c.model)
    try:
        cfg_dict = json.loads((path / "config.json").read_text())
        n_params = param_count(cfg_dict)
        run = _run_mambaserve if c.backend == "mambaserve" else _run_hf
        prefill_s, steps, mcfg, load_s = run(path, c)
    finally:
        if tmp is not None:
            tmp.cleanup()
    mcfg = mcfg if isinstance(mcfg, ModelConfig) else ModelConfig.from_dict(cfg_dict)
    step = statistics.median(steps) if steps else float("nan")
    weight_bytes = n_params * dtype.itemsize
    ssm_dtype = resolve_dtype(c.engine.get("mamba_ssm_dtype", "float32"))
    ctx = c.input_len + c.output_len // 2
    step_bytes = decode_step_bytes(mcfg, weight_bytes, c.batch_size, ctx, dtype, ssm_dtype)
    tokens = c.batch_size * c.input_len
    bw = step_bytes / step if steps else float("nan")
    return OneBatchResult(
        backend=c.backend, device=str(device), dtype=str(dtype).removeprefix("torch."),
        batch_size=c.batch_size, input_len=c.input_len, output_len=c.output_len, params=n_params,
        prefill_s=prefill_s, prefill_tokens_per_s=tokens / prefill_s, decode_step_s=step,
        decode_tokens_per_s=c.batch_size / step if steps else float("nan"), decode_steps=steps,
        matmul_ceiling_flops=mm["flops"], copy_ceiling_bytes_per_s=cp["bytes_per_s"],
        prefill_mfu=2 * n_params * tokens / prefill_s / mm["flops"],
        decode_bytes_per_step=step_bytes, decode_bandwidth=bw,
        decode_bandwidth_fraction=bw / cp["bytes_per_s"], load_s=load_s, note=note)


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.3f} M"


def format_result(r: OneBatchResult) -> str:
    lines = [
        (f"backend {r.backend} on {r.device} ({r.dtype}), {_count(r.params)} params, "
        f"batch {r.batch_size} x input {r.input_len}, output {r.output_len} (load {r.load_s:.1f} s)"),
        (f"prefill: {r.prefill_s * 1e3:.2f} ms, {r.prefill_tokens_per_s:,.0f} tokens/s, "
        f"MFU {100 * r.prefill_mfu:.1f} % of {r.matmul_ceiling_flops / 1e12:.2f} TFLOP/s"),
        (f"decode:  {r.decode_step_s * 1e3:.2f} ms/step (median of {len(r.decode_steps)}), "
        f"{r.decode_tokens_per_s:,.1f} tokens/s, {r.decode_bandwidth / 1e9:.1f} GB/s = "
        f"{100 * r.decode_bandwidth_fraction:.1f} % of {r.copy_ceiling_bytes_per_s / 1e9:.1f} GB/s "
        f"({r.decode_bytes_per_step / 1e9:.3f} GB per step: weights + state read/write + KV)"),
    ]
    if r.note:
        lines.append(f"note: {r.note}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", default=None, help="HF checkpoint folder")
    src.add_argument("--preset", default=None, help="nemotron-nano-9b-v2 | tiny (random weights)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--backend", default="mambaserve", choices=["mambaserve", "hf"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--save-reload", default=None, metavar="DIR",
                   help="folder the preset checkpoint is written to and loaded from "
                        "(default: a temporary folder, removed afterwards)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs on the same shapes")
    p.add_argument("--engine", default="", metavar="K=V,...",
                   help="extra EngineConfig settings, e.g. enforce_eager=false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the result as JSON")


def run_cli(a: argparse.Namespace) -> int:
    try:
        c = OneBatchConfig(model=a.model, preset=a.preset, batch_size=a.batch_size,
                           input_len=a.input_len, output_len=a.output_len, backend=a.backend,
                           device=a.device, dtype=a.dtype, save_reload=a.save_reload,
                           warmup=a.warmup, seed=a.seed, engine=parse_settings(a.engine))
        r = run_one_batch(c)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_result(r))
    if a.out:
        Path(a.out).write_text(json.dumps(asdict(r), indent=1))
    return 0
