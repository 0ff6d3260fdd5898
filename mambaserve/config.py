"""One normalized view of a checkpoint's config.json, and the engine's own settings.

Nothing downstream reads raw HF config keys: `ModelConfig.from_hf` hands the raw dict to its
family's reader (mambaserve/hf_configs/), the only place that knows the spellings found in the
wild. Every field's default reproduces NemotronH, the first family.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mambaserve.hf_configs import MODEL_TYPES, READERS
from mambaserve.hf_configs.nemotron_h import PATTERN_CHARS
from mambaserve.model_layout import FFNKind, LayerKind, LayerSpec

SUPPORTED_ARCHITECTURES = tuple(READERS)


@dataclass(frozen=True)
class ModelConfig:
    """Normalized description of a hybrid Mamba2 model (all sizes are plain ints)."""

    architecture: str
    layer_kinds: tuple[LayerKind, ...]  # NemotronH's one-block layers; () for other families
    vocab_size: int
    hidden_size: int
    norm_eps: float
    tie_word_embeddings: bool
    # attention
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    # MLP
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
    time_step_min: float
    time_step_limit: tuple[float, float]
    prefill_dt_limit: tuple[float, float]  # dt clamp of the chunked scan (multi-token forwards)
    decode_dt_limit: tuple[float, float]  # dt clamp of the one-token state update
    layers: tuple[LayerSpec, ...] = ()  # what each decoder layer holds (model_layout.py)
    mamba_in_proj_bias: bool = False
    mamba_out_proj_bias: bool = False
    # gated norm of the mixer output: "gate_then_norm" w * norm(y * silu(z)), "norm_then_gate"
    # (w * norm(y)) * silu(z), or "none" y * silu(z)
    mamba_norm: str = "gate_then_norm"
    mamba_norm_weight_fp32: bool = False  # weight multiply in float32 before the cast (Falcon-H1)
    residual_in_fp32: bool = False  # the residual stream stays float32 (Mamba2)
    # attention options
    attention_bias: bool = False
    attention_scale: float | None = None  # None: head_dim ** -0.5
    rope_theta: float | None = None  # None: no positional encoding (NemotronH, Granite "nope")
    rotary_dim: int = 0  # channels rotated (NeoX pairs); 0: all of head_dim
    # feed-forward options
    moe_router: str = "sigmoid_grouped"  # NemotronH's; "softmax_topk" (Granite)
    # muP-style multipliers (1.0 = none): embedding output, logits, every sub-block's output,
    # attention input / output / keys, Mamba mixer input / output, the in_proj output segments
    # (z, x, B, C, dt), the MLP gate pre-activation and down projection
    embedding_multiplier: float = 1.0
    logits_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_proj_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0
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
        return len(self.layers)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_layer_ids(self) -> list[int]:
        """Layers holding Mamba state, in state-pool order."""
        return [i for i, spec in enumerate(self.layers) if spec.mamba]

    @property
    def attention_layer_ids(self) -> list[int]:
        """Layers holding a KV cache, in KV-pool order."""
        return [i for i, spec in enumerate(self.layers) if spec.attention]

    @property
    def has_moe(self) -> bool:
        return any(spec.ffn is FFNKind.MOE for spec in self.layers)

    @property
    def pattern(self) -> str:
        """NemotronH's hybrid_override_pattern (empty for other families)."""
        inverse = {v: k for k, v in PATTERN_CHARS.items()}
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
        arch = archs[0] if archs else MODEL_TYPES.get(raw.get("model_type"))
        if arch not in READERS:
            raise ValueError(
                f"unsupported architecture {arch!r} (model_type={raw.get('model_type')!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            fields = READERS[arch](raw)
        except (TypeError, KeyError) as e:
            raise ValueError(f"config.json of {arch} is missing or mistypes a field: {e}") from None
        fields.setdefault("layer_kinds", ())
        cfg = cls(architecture=arch, **fields)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not self.layers:
            raise ValueError("the model has no layers")
        if self.mamba_layer_ids and self.mamba_num_heads % self.n_groups:
            raise ValueError(f"mamba_num_heads={self.mamba_num_heads} is not a multiple of "
                             f"n_groups={self.n_groups}")
        if self.attention_layer_ids and self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_kv_heads}")
        if self.has_moe and (self.n_routed_experts <= 0 or self.num_experts_per_tok <= 0):
            raise ValueError("MoE layers need n_routed_experts > 0 and num_experts_per_tok > 0")
        if self.n_routed_experts and self.n_routed_experts % self.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")
        if self.chunk_size <= 0 or self.conv_kernel < 2:
            raise ValueError("chunk_size must be > 0 and conv_kernel >= 2")
        if self.mamba_norm not in ("gate_then_norm", "norm_then_gate", "none"):
            raise ValueError(f"unknown mamba_norm {self.mamba_norm!r}")
        if len(self.ssm_proj_multipliers) != 5:
            raise ValueError("ssm_proj_multipliers has one value per in_proj segment "
                             "(z, x, B, C, dt)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and <= head_dim")


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


def resolve_device(name: str | torch.device) -> str:
    """The device an engine runs on: "auto" is cuda when torch sees a CUDA device, else cpu;
    any other name is returned as given."""
    if str(name) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(name)

# prefill tokens of the largest prefill / mixed CUDA graph on a GPU by default: prompts up to it
# (and a follow-up turn's uncached suffix) get their first token in about a decode step, and the
# steady prefill cap slices arrivals into graph-sized pieces beside running decodes
# (docs/benchmarks.md: serving ITL p99 and short-prompt TTFT)
DEFAULT_PREFILL_GRAPH_TOKENS = 256
# prefill tokens of the largest prefill-only graph (a lone prompt, nothing decoding beside it)
# by default: eagerly such a step is bound by the host's ~1,000 launches wherever the model's
# device time is short (Granite-micro 1x2048: ~37 ms of launches for ~23 ms of device time,
# docs/benchmarks.md run 14); a fresh lone prompt's graph runs its attention dense
DEFAULT_SOLO_GRAPH_TOKENS = 2048
SCHEDULING_POLICIES = ("fcfs", "priority")  # EngineConfig.scheduling_policy's values


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine instance. Every field has a command-line flag of the same name in
    kebab case (`add_cli_args`), except memory_budget_bytes, given as `--memory-budget-gb`."""

    dtype: str = "auto"
    device: str = "auto"  # cuda when torch sees a CUDA device, else cpu (resolve_device)
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
    # steps with a prefill part of at most this many tokens replay prefill / mixed CUDA graphs
    # when graphs are on (engine/prefill_graph.py; prefill-only steps up to the solo bound
    # below); 0 = those steps always run eagerly; None = DEFAULT_PREFILL_GRAPH_TOKENS on CUDA, 0
    # elsewhere
    cuda_graph_max_prefill_tokens: int | None = None
    # prefill-only steps (a lone prompt) with at most this many tokens replay graphs when
    # prefill graphs are on; None = max(DEFAULT_SOLO_GRAPH_TOKENS, 2 x the bound above) within
    # max_model_len; never below that bound nor above chunked_prefill_size
    cuda_graph_max_solo_tokens: int | None = None
    # "auto": safetensors weights; "dummy": random weights at the config's shapes (benchmarks)
    load_format: str = "auto"
    # overlap scheduling (docs/architecture.md, "The step loop"): None = on when the device is
    # CUDA, off on a CPU; True / False force it
    async_scheduling: bool | None = None
    # prefill tokens of one step while decodes run (the ITL / TTFT trade-off in
    # docs/architecture.md); steps without decodes take up to chunked_prefill_size
    max_step_prefill_tokens: int = 2048
    # the tighter cap while decodes run and the prompt tokens still to prefill are at most
    # max_step_prefill_tokens (steady arrivals); None: the largest prefill-graph bucket when
    # prefill graphs are on (cuda_graph_max_prefill_tokens), else no tighter cap
    steady_step_prefill_tokens: int | None = None
    # on-the-fly weight quantization after loading a bf16 / fp32 checkpoint: None or "fp8"
    # (docs/quantization.md); an FP8 checkpoint loads as FP8 whatever this says
    quantization: str | None = None
    # module-name patterns (fnmatch, comma-separated) on-the-fly FP8 leaves in the model dtype;
    # None: attention projections and lm_head, as NVIDIA's FP8 NemotronH checkpoint
    quantization_exclude: str | None = None
    # ranks of tensor parallelism (docs/tensor_parallel.md): 1 runs in this process alone, N
    # spawns ranks 1..N-1 as worker processes, this process being rank 0
    tensor_parallel_size: int = 1
    # vLLM's --scheduling-policy: "fcfs" (a request priority other than 0 is refused) or
    # "priority" (engine/request_queue.py; docs/architecture.md, "The step loop")
    scheduling_policy: str = "fcfs"

    def validate(self) -> None:
        """Raise a one-line ValueError naming the first bad field ("<field> must be ...")."""
        def check(ok: bool, field: str, problem: str) -> None:
            if not ok:
                raise ValueError(f"{field} {problem}")

        check(isinstance(self.dtype, torch.dtype) or self.dtype in ("auto", *_DTYPES), "dtype",
              f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        check(str(self.device) in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:"),
              "device", f"must be cpu or cuda[:N], or auto (cuda when torch sees one), got "
                        f"{self.device!r}")
        check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        check(self.chunked_prefill_size >= 1, "chunked_prefill_size",
              f"must be >= 1, got {self.chunked_prefill_size}")
        check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
              f"must be >= 2 (one prompt token and one output token), got {self.max_model_len}")
        check(self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        check(self.memory_budget_bytes is None or self.memory_budget_bytes >= 1,
              "memory_budget_bytes", f"must be positive, got {self.memory_budget_bytes} bytes")
        check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
              f"must be in (0, 1], got {self.gpu_memory_utilization}")
        check(isinstance(self.mamba_ssm_dtype, torch.dtype) or self.mamba_ssm_dtype in _DTYPES,
              "mamba_ssm_dtype",
              f"must be float32, bfloat16 or float16, got {self.mamba_ssm_dtype!r}")
        check(self.mamba_snapshot_interval is None or self.mamba_snapshot_interval >= 1,
              "mamba_snapshot_interval",
              f"must be a positive number of tokens, got {self.mamba_snapshot_interval}")
        check(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs",
              f"must be >= 1, got {self.cuda_graph_max_bs}")
        check(self.cuda_graph_max_prefill_tokens is None or self.cuda_graph_max_prefill_tokens >= 0,
              "cuda_graph_max_prefill_tokens",
              f"must be >= 0 (0 = off), got {self.cuda_graph_max_prefill_tokens}")
        check(self.cuda_graph_max_solo_tokens is None or self.cuda_graph_max_solo_tokens >= 0,
              "cuda_graph_max_solo_tokens",
              f"must be >= 0, got {self.cuda_graph_max_solo_tokens}")
        check(self.max_step_prefill_tokens >= 1, "max_step_prefill_tokens",
              f"must be >= 1, got {self.max_step_prefill_tokens}")
        check(self.steady_step_prefill_tokens is None or self.steady_step_prefill_tokens >= 1,
              "steady_step_prefill_tokens", f"must be >= 1, got {self.steady_step_prefill_tokens}")
        check(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
              "tensor_parallel_size", f"must be an integer >= 1, got {self.tensor_parallel_size!r}")
        check(self.load_format in ("auto", "dummy"), "load_format",
              f"must be auto or dummy, got {self.load_format!r}")
        check(self.quantization in (None, "fp8"), "quantization",
              f"must be fp8 or unset, got {self.quantization!r}")
        check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
              f"must be fcfs or priority, got {self.scheduling_policy!r}")

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
    "device": ("--device", dict(help="auto | cpu | cuda | cuda:N; auto: cuda when torch sees a "
                                     "CUDA device, else cpu (default: %(default)s)")),
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
        help="dtype of the Mamba SSM state: float32 | bfloat16 | float16; vLLM's "
             "--mamba_ssm_cache_dtype (default: %(default)s)")),
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
    "cuda_graph_max_prefill_tokens": ("--cuda-graph-max-prefill-tokens", dict(
        type=int, help="steps whose prefill part has at most this many tokens (up to 4 prefill "
                       "rows, plus decode rows; prefill-only steps: --cuda-graph-max-solo-tokens) "
                       "replay CUDA graphs too; 0 = they run eagerly (default: 256 on a GPU, 0 "
                       "on a CPU)")),
    "cuda_graph_max_solo_tokens": ("--cuda-graph-max-solo-tokens", dict(
        type=int, help="prefill-only steps (a lone prompt) of at most this many tokens replay "
                       "CUDA graphs when prefill graphs are on (default: the larger of 2048 "
                       "and twice --cuda-graph-max-prefill-tokens, at most max_model_len)")),
    "load_format": ("--load-format", dict(
        choices=["auto", "dummy"], help="auto: safetensors weights; dummy: random weights at "
                                        "the config's shapes (benchmarks; the model folder "
                                        "needs only config.json) (default: %(default)s)")),
    "async_scheduling": ("--async-scheduling", dict(
        action=argparse.BooleanOptionalAction,
        help="overlap scheduling: schedule and launch step N+1 while step N runs, read step N's "
             "tokens after; default: on on a GPU, off on a CPU (docs/architecture.md)")),
    "max_step_prefill_tokens": ("--max-step-prefill-tokens", dict(
        type=int, help="prefill tokens per step while decodes run: lower keeps inter-token "
                       "latency flat, higher gives a new request its first token sooner "
                       "(default: %(default)s)")),
    "steady_step_prefill_tokens": ("--steady-step-prefill-tokens", dict(
        type=int, help="the tighter prefill cap while decodes run and the prompt tokens still to "
                       "prefill fit in --max-step-prefill-tokens (steady arrivals keep ITL near "
                       "a decode step); default: the largest prefill-graph bucket when "
                       "--cuda-graph-max-prefill-tokens is on, else none")),
    "quantization": ("--quantization", dict(
        choices=["fp8"], help="quantize the linear projections to FP8 after loading a bf16 / "
                              "fp32 checkpoint (per-channel weight scales, per-token "
                              "activation scales; docs/quantization.md); FP8 checkpoints load "
                              "as FP8 without it")),
    "quantization_exclude": ("--quantization-exclude", dict(
        help="comma-separated module-name patterns --quantization fp8 leaves unquantized "
             "(default: lm_head,*.q_proj,*.k_proj,*.v_proj,*.o_proj)")),
    "tensor_parallel_size": ("--tensor-parallel-size", dict(
        type=int, help="split the model over N processes (one per GPU, gloo on a CPU), this one "
                       "being rank 0; docs/tensor_parallel.md (default: %(default)s)")),
    "scheduling_policy": ("--scheduling-policy", dict(
        choices=list(SCHEDULING_POLICIES),
        help="fcfs: requests are admitted in arrival order (a request priority other than 0 is "
             "refused); priority: by (priority, arrival), lower first, and the running request "
             "with the largest (priority, arrival) is preempted first (default: %(default)s)")),
}
