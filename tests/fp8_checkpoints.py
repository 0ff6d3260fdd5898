"""FP8 checkpoints written by the tests, laid out as the published ones are (docs/quantization.md),
from a tiny bf16/fp32 checkpoint; and the reference the engine is compared with: the same model
with every quantized projection replaced by an explicit quantize -> dequantize -> float32 matmul
written here (independent of mambaserve's FP8 code).

- "modelopt": NVIDIA ModelOpt FP8 (`quant_algo: FP8`): per-tensor float32 `weight_scale` and a
  static per-tensor `input_scale` (calibrated: max |input| over a few prompts run through
  transformers, / 448), both 0-d; `hf_quant_config.json` with `exclude_modules`, and the same in
  config.json's `quantization_config` (quant_method "modelopt").
- "compressed-tensors": llm-compressor's FP8-Dynamic (`config_groups` with channel weights
  and dynamic per-token activations): `weight_scale` [out, 1], no input scale; an `ignore` list.

Quantized: the Mamba in_proj / out_proj and the MLP projections (shared experts included);
attention, lm_head, embeddings, conv1d, routers and routed experts stay as they are, as in
NVIDIA's FP8 NemotronH checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

FP8 = torch.float8_e4m3fn
QUANT_LEAVES = ("in_proj", "out_proj", "up_proj", "down_proj", "gate_proj", "input_linear",
                "output_linear")


def fp8_targets(state: dict[str, torch.Tensor]) -> list[str]:
    """Checkpoint module names an FP8 checkpoint of these families quantizes."""
    return sorted(k[: -len(".weight")] for k, v in state.items()
                  if k.endswith(".weight") and v.dim() == 2 and ".experts." not in k
                  and k[: -len(".weight")].rsplit(".", 1)[-1] in QUANT_LEAVES)


def calibrate(src: Path, names: list[str], prompts: list[list[int]]) -> dict[str, float]:
    """max |input| of each module `names` over `prompts`, run through transformers."""
    from family_checkpoints import load_hf

    model = load_hf(src)
    amax: dict[str, float] = dict.fromkeys(names, 0.0)
    # transformers' in-memory names may differ from the saved ones in their first component
    # (NemotronH saves `backbone.`, transformers 5 holds `model.`)
    modules = {n.split(".", 1)[-1]: m for n, m in model.named_modules()}
    hooks = []
    for name in names:
        def hook(mod, args, name=name):
            amax[name] = max(amax[name], args[0].detach().abs().max().item())
        hooks.append(modules[name.split(".", 1)[-1]].register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            model(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return amax


def _quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = amax.clamp_min(1e-12) / 448.0
    return (w / scale).clamp(-448.0, 448.0).to(FP8), scale


def write_fp8_checkpoint(src: Path, dst: Path, fmt: str, calib: list[list[int]] | None = None,
                         config_json: bool = True) -> dict[str, tuple]:
    """Write `src` as an FP8 checkpoint in `fmt` into `dst`; returns {checkpoint module name:
    (fp8 weight, weight scale, input scale or None)} for the reference. `config_json=False`
    (ModelOpt) leaves config.json without quantization_config: hf_quant_config.json only."""
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(src / "model.safetensors"))
    names = fp8_targets(state)
    amax = calibrate(src, names, calib) if fmt == "modelopt" else {}
    out, quant = dict(state), {}
    for name in names:
        w = state[f"{name}.weight"]
        if fmt == "modelopt":
            q, ws = _quantize(w, per_channel=False)
            xs = torch.tensor(max(amax[name], 1e-12) / 448.0, dtype=torch.float32)
            out[f"{name}.input_scale"] = xs
        else:
            q, ws = _quantize(w, per_channel=True)  # [out, 1]
            xs = None
        out[f"{name}.weight"], out[f"{name}.weight_scale"] = q, ws.float()
        quant[name] = (q, ws.float().reshape(-1), xs)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    excluded = sorted({k.rsplit(".", 1)[0] for k in state
                       if k.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj")})
    if fmt == "modelopt":
        hf_quant = {"producer": {"name": "modelopt", "version": "0.37.0"},
                    "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                     "exclude_modules": ["lm_head", "*conv1d*", *excluded]}}
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2))
        if config_json:
            cfg["quantization_config"] = {"quant_method": "modelopt", **hf_quant}
    else:
        args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                "block_structure": None, "actorder": None, "observer_kwargs": {}}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "float-quantized", "output_activations": None,
                "weights": {**args, "strategy": "channel", "dynamic": False,
                            "observer": "minmax"},
                "input_activations": {**args, "strategy": "token", "dynamic": True,
                                      "observer": None}}},
            "ignore": ["lm_head", "re:.*conv1d.*", *excluded]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return quant


class RefQuantLinear(nn.Module):
    """quantize x (static scale, or max|row| / 448 per token) -> dequantize both -> float32
    matmul -> x's dtype."""

    def __init__(self, q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.w = q.float() * w_scale.float().reshape(-1, 1)
        self.x_scale, self.bias = x_scale, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w.device != x.device:  # the checkpoint's tensors, for a model on another device
            self.w = self.w.to(x.device)
        xf = x.float()
        if self.x_scale is None:
            amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
            s = amax / torch.full_like(amax, 448.0)  # IEEE on every device, as the engine's
        else:
            s = self.x_scale.float().to(x.device)
        xq = (xf / s).clamp(-448.0, 448.0).to(FP8).float() * s
        y = xq @ self.w.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def install_reference(model: nn.Module, name_map, quant: dict[str, tuple]) -> list[str]:
    """Replace, in our loaded (unquantized) model, every module `quant` names (checkpoint names,
    mapped through the family's `name_map`) by its RefQuantLinear; a GatedMLP whose halves are
    quantized gets a forward over reference halves. Returns our module names replaced."""
    gated: dict[str, dict[int, RefQuantLinear]] = {}
    done = []
    for ck_name, (q, ws, xs) in quant.items():
        pname, index = name_map(f"{ck_name}.weight")
        owner, _, leaf = pname.rpartition(".")
        if leaf == "weight":
            parent_name, _, attr = owner.rpartition(".")
            parent = model.get_submodule(parent_name)
            bias = getattr(parent, attr).bias
            setattr(parent, attr, RefQuantLinear(q, ws, xs, bias))
            done.append(owner)
        else:
            assert leaf == "gate_up_weight", pname
            mlp = model.get_submodule(owner)
            I = mlp.intermediate_size
            if index is None:  # fused [2I, H]
                gated[owner] = {0: RefQuantLinear(q[:I], ws[:I], xs),
                                1: RefQuantLinear(q[I:], ws[I:], xs)}
            else:
                gated.setdefault(owner, {})[index] = RefQuantLinear(q, ws, xs)
    for owner, halves in gated.items():
        mlp = model.get_submodule(owner)
        # both halves read the same input: their (equal, calibrated on it) scales -> the max
        scales = [h.x_scale for h in halves.values()]
        if scales[0] is not None:
            for h in halves.values():
                h.x_scale = torch.stack(scales).max()

        def forward(x, mlp=mlp, gate=halves[0], up=halves[1]):
            g = gate(x)
            if mlp.gate_multiplier != 1.0:
                g = g * mlp.gate_multiplier
            out = mlp.down_proj(F.silu(g) * up(x))
            return out * mlp.down_multiplier if mlp.down_multiplier != 1.0 else out

        mlp.forward = forward
        done.append(f"{owner}.gate_up")
    return done
