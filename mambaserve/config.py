"""One normalized view of a checkpoint's config.json, and the engine's own settings.

Nothing downstream reads raw HF config keys: `ModelConfig.from_hf` is the only place that knows
the spellings found in the wild (hub checkpoints write `hybrid_override_pattern`, transformers 5
writes `layers_block_type`; older names such as `mamba_d_conv` are accepted too).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("NemotronHForCausalLM",)


class LayerKind(str, Enum):
    MAMBA = "mamba"
    ATTENTION = "attention"
    MLP = "mlp"
    MOE = "moe"


# Every spelling of a layer kind seen in NemotronH configs, by the key that carries it.
_PATTERN_CHARS = {"M": LayerKind.MAMBA, "*": LayerKind.ATTENTION, "-": LayerKind.MLP,
                  "E": LayerKind.MOE}
_BLOCK_TYPE_NAMES = {
    "mamba": LayerKind.MAMBA, "linear_attention": LayerKind.MAMBA,
    "attention": LayerKind.ATTENTION, "full_attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP, "moe": LayerKind.MOE,
}


def _decode_float(value: Any) -> float:
    """transformers writes non-finite floats as {"__float__": "Infinity"}; JSON has no inf."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    if isinstance(value, str):
        return float(value)
    return float(value)


@dataclass(frozen=True)
class ModelConfig:
    """Normalized NemotronH-family model description (all sizes are plain ints)."""

    architecture: str
    layer_kinds: tuple[LayerKind, ...]
    vocab_size: int
    hidden_size: int
    norm_eps: float
    tie_word_embeddings: bool
    # attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    # MLP (relu^2)
    intermediate_size: int
    mlp_bias: bool
    # Mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    use_bias: bool
    time_step_min: float
    time_step_limit: tuple[float, float]
    # MoE
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # tokens
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "float32"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k is LayerKind.MAMBA]

    @property
    def attention_layer_ids(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k is LayerKind.ATTENTION]

    @property
    def prefill_dt_limit(self) -> tuple[float, float]:
        """dt clamp of the chunked scan. NOTE: transformers' NemotronH clamps prefill dt to
        (time_step_min, inf) and leaves decode dt unclamped, ignoring `time_step_limit`; we follow
        the reference exactly (see docs/architecture.md), keeping the limit's upper bound."""
        return (self.time_step_min, self.time_step_limit[1])

    @property
    def decode_dt_limit(self) -> tuple[float, float]:
        return (0.0, math.inf)

    @property
    def pattern(self) -> str:
        inverse = {v: k for k, v in _PATTERN_CHARS.items()}
        return "".join(inverse[k] for k in self.layer_kinds)

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ValueError(f"no config.json found at {path}: not a Hugging Face checkpoint folder")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed config.json at {file}: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ("NemotronHForCausalLM" if raw.get("model_type") ==
                                        "nemotron_h" else None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type={raw.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def get(*names: str, default: Any = None) -> Any:
            for n in names:
                if n in raw and raw[n] is not None:
                    return raw[n]
            return default

        kinds = _layer_kinds(raw)
        hidden = int(get("hidden_size"))
        n_heads = int(get("num_attention_heads", default=32))
        limit = get("time_step_limit", "mamba_dt_limit", default=[0.0, math.inf])
        eos = get("eos_token_id", default=[])
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        cfg = cls(
            architecture=arch,
            layer_kinds=kinds,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            norm_eps=float(get("layer_norm_epsilon", "rms_norm_eps", default=1e-5)),
            tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
            num_attention_heads=n_heads,
            num_kv_heads=int(get("num_key_value_heads", default=n_heads)),
            head_dim=int(get("head_dim", "attention_head_dim", default=hidden // n_heads)),
            max_position_embeddings=int(get("max_position_embeddings", default=4096)),
            intermediate_size=int(get("intermediate_size", default=4 * hidden)),
            mlp_bias=bool(get("mlp_bias", default=False)),
            mamba_num_heads=int(get("mamba_num_heads", default=128)),
            mamba_head_dim=int(get("mamba_head_dim", default=64)),
            ssm_state_size=int(get("ssm_state_size", default=128)),
            n_groups=int(get("n_groups", "mamba_n_groups", default=8)),
            conv_kernel=int(get("conv_kernel", "mamba_d_conv", default=4)),
            chunk_size=int(get("chunk_size", "mamba_chunk_size", default=128)),
            use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", default=True)),
            use_bias=bool(get("use_bias", default=False)),
            time_step_min=float(get("time_step_min", "mamba_dt_min", default=0.001)),
            time_step_limit=(_decode_float(limit[0]), _decode_float(limit[1])),
            n_routed_experts=int(get("n_routed_experts", "num_local_experts", default=0)),
            num_experts_per_tok=int(get("num_experts_per_tok", default=0)),
            moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
            moe_shared_expert_intermediate_size=int(
                get("moe_shared_expert_intermediate_size", default=0)),
            n_group=int(get("n_group", default=1)),
            topk_group=int(get("topk_group", default=1)),
            norm_topk_prob=bool(get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
            eos_token_ids=eos_ids,
            bos_token_id=get("bos_token_id"),
            pad_token_id=get("pad_token_id"),
            torch_dtype=str(get("dtype", "torch_dtype", default="float32")),
            extra={"mamba_ssm_cache_dtype": get("mamba_ssm_cache_dtype", default="float32")},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of "
                             f"n_groups={self.n_groups}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_kv_heads}")
        if LayerKind.MOE in self.layer_kinds and (
                self.n_routed_experts <= 0 or self.num_experts_per_tok <= 0):
            raise ValueError("MoE layers need n_routed_experts > 0 and num_experts_per_tok > 0")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        if self.chunk_size <= 0 or self.conv_kernel < 2:
            raise ValueError("chunk_size must be > 0 and conv_kernel >= 2")


def _layer_kinds(raw: dict[str, Any]) -> tuple[LayerKind, ...]:
    pattern = raw.get("hybrid_override_pattern")
    blocks = raw.get("layers_block_type") or raw.get("layer_types")
    if blocks:
        try:
            return tuple(_BLOCK_TYPE_NAMES[b] for b in blocks)
        except KeyError as e:
            raise ValueError(f"unknown layer type {e.args[0]!r} in layers_block_type; known: "
                             f"{sorted(_BLOCK_TYPE_NAMES)}") from None
    if pattern:
        try:
            return tuple(_PATTERN_CHARS[c] for c in pattern)
        except KeyError as e:
            raise ValueError(f"unknown character {e.args[0]!r} in hybrid_override_pattern; "
                             f"known: {''.join(_PATTERN_CHARS)}") from None
    raise ValueError("config.json has neither hybrid_override_pattern nor layers_block_type")


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_dtype(name: str | torch.dtype, model_cfg: ModelConfig | None = None,
                  device: str = "cpu") -> torch.dtype:
    """`auto` takes the checkpoint's dtype, except float32 on a CPU for half checkpoints."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        ckpt = _DTYPES.get(model_cfg.torch_dtype if model_cfg else "float32", torch.float32)
        return torch.float32 if device == "cpu" else ckpt
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. Every field has a command-line flag of the same name in
    kebab case (`add_cli_args`), except memory_budget_bytes, given as `--memory-budget-gb`."""

    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 64
    chunked_prefill_size: int = 2048  # token budget of one forward
    max_model_len: int | None = None
    page_size: int = 16  # tokens per KV page
    memory_budget_bytes: int | None = None  # state + KV pools; None = sized from the device
    gpu_memory_utilization: float = 0.85
    mamba_ssm_dtype: str = "float32"
    enable_prefix_caching: bool = False
    mamba_snapshot_interval: int | None = None
    seed: int = 0
    # decode CUDA graphs (engine/cuda_graph.py): None = graphs on CUDA, eager elsewhere; True =
    # always eager; False on a CPU runs the static-buffer path uncaptured (tests).
    enforce_eager: bool | None = None
    cuda_graph_max_bs: int = 256
    # "auto": safetensors weights; "dummy": random weights at the config's shapes (benchmarks)
    load_format: str = "auto"

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one output "
                             f"token), got {self.max_model_len}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ValueError(f"the memory budget must be positive, got "
                             f"{self.memory_budget_bytes} bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")

    # ---- command line ----------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field to `parser`, defaults taken from the fields; help strings
        show them. `from_cli` reads the parsed namespace back."""
        for name, (flag, kwargs) in _CLI_FLAGS.items():
            default = cls.__dataclass_fields__[name].default
            if name == "memory_budget_bytes":
                default = None if default is None else default / 2**30
            parser.add_argument(flag, dest=_cli_dest(name), default=default, **kwargs)

    @classmethod
    def from_cli(cls, namespace: argparse.Namespace) -> EngineConfig:
        """The EngineConfig of a namespace parsed by a parser given `add_cli_args`;
        validated, so a bad flag is a one-line ValueError."""
        values = {}
        for name in _CLI_FLAGS:
            dest = _cli_dest(name)
            if not hasattr(namespace, dest):
                raise ValueError(f"the parsed arguments have no {_CLI_FLAGS[name][0]}: build the "
                                 f"parser with EngineConfig.add_cli_args")
            values[name] = getattr(namespace, dest)
        gib = values["memory_budget_bytes"]
        if gib is not None:
            if not gib > 0:
                raise ValueError(f"--memory-budget-gb must be positive, got {gib}")
            values["memory_budget_bytes"] = int(gib * 2**30)
        config = cls(**values)
        config.validate()
        return config


def _cli_dest(field_name: str) -> str:
    return "memory_budget_gb" if field_name == "memory_budget_bytes" else field_name


# EngineConfig field -> (flag, argparse keywords but the default, which comes from the field).
# The memory budget is given in GiB on the command line, in bytes in the field.
_CLI_FLAGS: dict[str, tuple[str, dict]] = {
    "dtype": ("--dtype", dict(help="weights and activations: auto | float32 | bfloat16 | "
                                   "float16; auto takes the checkpoint's, float32 on a CPU "
                                   "(default: %(default)s)")),
    "device": ("--device", dict(help="cpu | cuda | cuda:N (default: %(default)s)")),
    "max_num_seqs": ("--max-num-seqs", dict(
        type=int, help="sequences running at once (default: %(default)s)")),
    "chunked_prefill_size": ("--chunked-prefill-size", dict(
        type=int, help="token budget of one forward (default: %(default)s)")),
    "max_model_len": ("--max-model-len", dict(
        type=int, help="prompt + output tokens per sequence (default: the checkpoint's "
                       "max_position_embeddings)")),
    "page_size": ("--page-size", dict(type=int, help="tokens per KV page (default: %(default)s)")),
    "memory_budget_bytes": ("--memory-budget-gb", dict(
        type=float, help="GiB for the state + KV pools (default: on a GPU, "
                         "--gpu-memory-utilization of its free memory; 1 GiB on a CPU)")),
    "gpu_memory_utilization": ("--gpu-memory-utilization", dict(
        type=float, help="share of the free GPU memory the pools may take when no "
                         "--memory-budget-gb is given, less 2 GiB for activations "
                         "(default: %(default)s)")),
    "mamba_ssm_dtype": ("--mamba-ssm-dtype", dict(
        help="dtype of the Mamba SSM state (default: %(default)s)")),
    "enable_prefix_caching": ("--enable-prefix-caching", dict(
        action="store_true", help="reuse KV pages and Mamba state snapshots of shared prompt "
                                  "prefixes")),
    "mamba_snapshot_interval": ("--mamba-snapshot-interval", dict(
        type=int, help="prefix-cache snapshot spacing in tokens, a multiple of the chunk size "
                       "and the page size (default: the least such multiple)")),
    "seed": ("--seed", dict(type=int, help="seed of the engine's random draws: dummy weights "
                                           "and requests without a seed (default: %(default)s)")),
    "enforce_eager": ("--enforce-eager", dict(
        action=argparse.BooleanOptionalAction,
        help="run every forward eagerly; default: decode-only batches replay CUDA graphs on a "
             "GPU, eager on a CPU (--no-enforce-eager forces the graph path; "
             "docs/cuda_graphs.md)")),
    "cuda_graph_max_bs": ("--cuda-graph-max-bs", dict(
        type=int, help="largest decode batch captured in a CUDA graph (default: %(default)s)")),
    "load_format": ("--load-format", dict(
        choices=["auto", "dummy"], help="auto: safetensors weights; dummy: random weights at "
                                        "the config's shapes (benchmarks; the model folder "
                                        "needs only config.json) (default: %(default)s)")),
}
