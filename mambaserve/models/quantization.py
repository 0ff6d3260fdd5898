"""FP8 weights: which checkpoints are FP8 and how, which modules hold FP8 weights, and on-the-fly
FP8 of a model loaded in bf16 / fp32 (docs/quantization.md).

Two checkpoint formats are read, from config.json's `quantization_config` (or, for ModelOpt, the
`hf_quant_config.json` beside it):

- ModelOpt (`quant_method: "modelopt"`): `quant_algo` "FP8" (per-tensor `weight_scale`,
  static per-tensor `input_scale`) or "FP8_PER_CHANNEL_PER_TOKEN" (per-row `weight_scale`,
  dynamic per-token activations); the excluded modules under `exclude_modules` / `ignore`;
- compressed-tensors (`quant_method: "compressed-tensors"`): `config_groups` whose weights are
  8-bit floats with strategy "channel" ([out, 1] `weight_scale`) or "tensor", and whose
  input activations are dynamic per "token" or static per "tensor" (`input_scale`).

Which modules are FP8 is read from the weights themselves (a float8_e4m3fn `<module>.weight`),
so whatever the excluded-module list names stays in the model dtype whatever its spelling; a
module with an `<module>.input_scale` tensor quantizes its input with that static scale, the
others per token on the device.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from mambaserve.layers.fp8_linear import quantize_linear_, swap_to_fp8
from mambaserve.layers.linear import is_plain_linear
from mambaserve.layers.mlp import GatedMLP

logger = logging.getLogger("mambaserve")

ONLINE_QUANTIZATIONS = ("fp8",)
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
# on-the-fly FP8 leaves these in the model dtype, as NVIDIA's FP8 NemotronH checkpoint does
# (attention projections and lm_head; conv1d, embeddings, norms, routers and routed experts are
# not linear projections and are never quantized). fnmatch patterns over our module names.
DEFAULT_FP8_EXCLUDE = ("lm_head", "*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj")
SCALE_SUFFIXES = (".weight_scale", ".input_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")  # FP8 KV-cache scales: the KV cache stays as is


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a checkpoint's quantization config says (validated)."""

    method: str  # "modelopt" | "compressed-tensors"
    scheme: str  # ModelOpt's quant_algo, or "w8a8-fp8" for compressed-tensors
    exclude: tuple[str, ...]  # the checkpoint's excluded modules, as written (documentation)


def read_checkpoint_quantization(path: Path, raw: dict) -> Fp8Checkpoint | None:
    """The FP8 description of the checkpoint folder `path` (config.json already parsed as
    `raw`), or None for an unquantized checkpoint. Anything else is a one-line ValueError."""
    qc = raw.get("quantization_config")
    hf_quant = path / "hf_quant_config.json"
    if qc is None and hf_quant.is_file():
        try:
            qc = json.loads(hf_quant.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed {hf_quant}: {e}") from None
        qc = {"quant_method": "modelopt", **qc}
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError("config.json's quantization_config is not an object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt" or (method == "" and "producer" in qc):
        return _modelopt(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"unsupported quantization method {qc.get('quant_method')!r} in "
                     "quantization_config; FP8 checkpoints of quant_method 'modelopt' or "
                     "'compressed-tensors' are supported")


def _modelopt(qc: dict) -> Fp8Checkpoint:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"unsupported ModelOpt quant_algo {inner.get('quant_algo')!r}; "
                         f"supported: {', '.join(MODELOPT_ALGOS)}")
    exclude = inner.get("exclude_modules", inner.get("ignore")) or []
    if not isinstance(exclude, list):
        raise ValueError("ModelOpt exclude_modules must be a list of module names / patterns")
    kv = inner.get("kv_cache_quant_algo")
    if kv:
        logger.warning("checkpoint has an FP8 KV-cache scheme (%s): ignored, the KV cache "
                       "stays in the model dtype", kv)
    return Fp8Checkpoint("modelopt", algo, tuple(map(str, exclude)))


def _fp8_args(args, where: str, strategies: tuple[str, ...]) -> str:
    if not isinstance(args, dict) or args.get("num_bits") != 8 or args.get("type") != "float":
        raise ValueError(f"unsupported compressed-tensors scheme: {where} must be 8-bit float "
                         f"(FP8), got {args!r}")
    if args.get("symmetric") is False:
        raise ValueError(f"unsupported compressed-tensors scheme: {where} is asymmetric")
    strategy = str(args.get("strategy"))
    if strategy not in strategies:
        raise ValueError(f"unsupported compressed-tensors {where} strategy {strategy!r}; "
                         f"supported: {', '.join(strategies)}")
    return strategy


def _compressed_tensors(qc: dict) -> Fp8Checkpoint:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    fmt = qc.get("format")
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ValueError(f"compressed-tensors config group {name!r} is not an object")
        gfmt = group.get("format") or fmt
        if gfmt not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"unsupported compressed-tensors format {gfmt!r} in group "
                             f"{name!r}; FP8 checkpoints are 'float-quantized'")
        _fp8_args(group.get("weights"), f"group {name!r} weights", ("channel", "tensor"))
        act = group.get("input_activations")
        if act is None:
            raise ValueError(f"compressed-tensors group {name!r} is weight-only FP8 "
                             "(input_activations null): not supported, only W8A8 FP8")
        strategy = _fp8_args(act, f"group {name!r} input_activations", ("token", "tensor"))
        if (strategy == "token") != bool(act.get("dynamic")):
            raise ValueError(f"compressed-tensors group {name!r}: activations must be dynamic "
                             "per token or static per tensor")
    if qc.get("kv_cache_scheme"):
        logger.warning("checkpoint has a KV-cache scheme: ignored, the KV cache stays in the "
                       "model dtype")
    ignore = qc.get("ignore") or []
    return Fp8Checkpoint("compressed-tensors", "w8a8-fp8", tuple(map(str, ignore)))


def fp8_weight_modules(fp8_weights: dict[str, bool], model: nn.Module) -> None:
    """Turn every module holding an FP8 checkpoint weight into its FP8 form, unfilled.
    `fp8_weights`: our weight parameter name -> whether the checkpoint gives it a static
    `input_scale`. nn.Linear weights (`<module>.weight`) become `Fp8Linear`s; GatedMLP's
    stacked gate|up (`<module>.gate_up_weight`) its FP8 stack; anything else is an error."""
    for pname, static in sorted(fp8_weights.items()):
        owner, _, leaf = pname.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        if leaf == "weight" and isinstance(module, nn.Linear):
            swap_to_fp8(model, owner, static)
        elif leaf == "gate_up_weight" and isinstance(module, GatedMLP):
            module.to_fp8(static, quantize=False)
        else:
            raise ValueError(f"FP8 weights for {pname} are not supported: only linear "
                             "projections take FP8 (routed experts, conv1d and embeddings stay "
                             "in the model dtype)")


def exclude_patterns(text: str | None) -> tuple[str, ...]:
    """EngineConfig.quantization_exclude ("a,b*,..." or None = the defaults) -> patterns."""
    if text is None:
        return DEFAULT_FP8_EXCLUDE
    return tuple(p.strip() for p in text.split(",") if p.strip())


def quantize_model_fp8(model: nn.Module, exclude: tuple[str, ...] = DEFAULT_FP8_EXCLUDE
                       ) -> list[str]:
    """On-the-fly FP8 of a loaded model: every nn.Linear and GatedMLP gate|up stack whose module
    name matches no `exclude` pattern (fnmatch) gets per-output-channel FP8 weights and dynamic
    per-token activation scales. Modules already FP8 are left as they are. Returns the names of
    the modules quantized."""
    done = []
    for name, module in list(model.named_modules()):
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        if is_plain_linear(module):
            quantize_linear_(model, name)
            done.append(name)
        elif isinstance(module, GatedMLP) and module.gate_up_weight_scale is None:
            module.to_fp8(static_input_scale=False, quantize=True)
            done.append(f"{name}.gate_up")
    return done
