"""Tiny random-weight checkpoints of the families after NemotronH (FalconH1, GraniteMoeHybrid,
Bamba, Mamba2), saved by transformers (the reference), and transformers' own prompt logprobs and
greedy tokens for them. Not imported by the suite yet; see /work/families_spec.md.

Every maker takes `(path, seed=0, **overrides)`: overrides go to the transformers config class.
Every parameter is redrawn from a seeded generator after construction (A_log, D, dt_bias, norm
weights, conv and router weights included), so nothing sits at an init value that hides a bug.
The variant dicts below are ready-made overrides for the other code paths of each family.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

_COMMON = dict(vocab_size=320, hidden_size=64, eos_token_id=2, bos_token_id=1, pad_token_id=0,
               max_position_embeddings=512)
_ROPE = {"rope_type": "default", "rope_theta": 1000.0}  # small theta: rotation matters at T~50

# Falcon-H1: every layer runs attention and Mamba2 in parallel. d_ssm (96) differs from
# expand * hidden (128) and head_dim (24) from hidden / heads (16), as in the published 7B;
# every multiplier differs from 1, each ssm_multipliers segment differently. The gated norm is on
# with norm_before_gate False (the published 7B / H1R setting).
FALCON_H1_KW = dict(
    _COMMON, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, mamba_conv_bias=True,
    mamba_proj_bias=False, mamba_rms_norm=True, mamba_norm_before_gate=False,
    rope_parameters=dict(_ROPE), embedding_multiplier=2.5, lm_head_multiplier=0.4,
    attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.6,
    ssm_in_multiplier=1.25, ssm_out_multiplier=0.7, ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.6],
    mlp_multipliers=[0.8, 1.4], rms_norm_eps=1e-5,
)
FALCON_H1_NO_MAMBA_NORM = dict(mamba_rms_norm=False)  # y * silu(z), no norm (0.5B setting)
FALCON_H1_NORM_BEFORE_GATE = dict(mamba_norm_before_gate=True)  # rmsnorm(y) * w * silu(z)
FALCON_H1_BIASES = dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                        projectors_bias=True)

# GraniteMoeHybrid (granite-4.0-h): Mamba2 or NoPE attention, then routed experts + shared MLP
# in every layer; embedding / residual / attention multipliers, logits divided by logits_scaling.
GRANITE_KW = dict(
    _COMMON, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4,
    num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=8, position_embedding_type="nope",
    rope_parameters=dict(_ROPE), embedding_multiplier=0.6, residual_multiplier=0.7,
    attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=True, rms_norm_eps=1e-5,
)
GRANITE_DENSE = dict(num_local_experts=0)  # shared MLP only (granite-4.0-h-micro / -350m)
GRANITE_ROPE = dict(position_embedding_type="rope")

# Bamba: Mamba2 layers and attention layers (by index) each followed by a SwiGLU MLP; RoPE on
# the first half of each head (partial_rotary_factor 0.5, forced by the config class).
BAMBA_KW = dict(
    _COMMON, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2,
    mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    rope_parameters=dict(_ROPE, partial_rotary_factor=0.5), rms_norm_eps=1e-5,
)

# Mamba2 (Mamba-Codestral): Mamba2 blocks only, residual in fp32. `norm_before_gate` and
# `rms_norm` are copied from Codestral's config.json: transformers ignores both (it always gates
# before the norm), so a loader that reads them is wrong.
MAMBA2_KW = dict(
    _COMMON, num_hidden_layers=3, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16,
    conv_kernel=4, chunk_size=8, use_bias=False, use_conv_bias=True, residual_in_fp32=True,
    layer_norm_epsilon=1e-5, tie_word_embeddings=False, norm_before_gate=True, rms_norm=True,
)

# any family: a dt clamp that bites (transformers clamps prefill dt only; decode is unclamped)
DT_LIMIT = dict(time_step_limit=(0.05, 0.3))


def _inv_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter: matrices ~ N(0, 1/fan_in) (lm_head and router 3x wider),
    embeddings ~ N(0, 0.5^2), norm weights ~ U(0.6, 1.4), biases ~ N(0, 0.1^2),
    A = -exp(A_log) ~ -U(0.5, 6), D ~ U(-0.5, 1.5), softplus(dt_bias) ~ U(0.02, 0.4)."""
    g = torch.Generator().manual_seed(seed)

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=g)

    for name, p in model.named_parameters():  # tied weights appear once
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            val = torch.log(uniform(p.shape, 0.5, 6.0))
        elif leaf == "D":
            val = uniform(p.shape, -0.5, 1.5)
        elif leaf == "dt_bias":
            val = _inv_softplus(uniform(p.shape, 0.02, 0.4))
        elif "norm" in name and leaf == "weight":
            val = uniform(p.shape, 0.6, 1.4)
        elif p.ndim == 1:  # biases (conv1d, projections)
            val = 0.1 * torch.randn(p.shape, generator=g)
        elif "embed" in name:  # also the lm_head of tied models: keep logits moderate
            val = 0.5 * torch.randn(p.shape, generator=g)
        else:  # [out, in], experts [E, out, in], conv1d [C, 1, K]: fan_in is the last dim
            scale = 3.0 if ("lm_head" in name or "router" in name) else 1.0
            val = torch.randn(p.shape, generator=g) * scale / math.sqrt(p.shape[-1])
        p.copy_(val.to(p.dtype))


def _build(config_cls_name: str, model_cls_name: str, defaults: dict, path, seed, overrides):
    import transformers

    cfg = getattr(transformers, config_cls_name)(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(cfg).float().eval()
    randomize_(model, seed)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_falcon_h1(path, seed: int = 0, **overrides) -> Path:
    return _build("FalconH1Config", "FalconH1ForCausalLM", FALCON_H1_KW, path, seed, overrides)


def make_tiny_granite_moe_hybrid(path, seed: int = 0, **overrides) -> Path:
    return _build("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", GRANITE_KW, path, seed,
                  overrides)


def make_tiny_bamba(path, seed: int = 0, **overrides) -> Path:
    return _build("BambaConfig", "BambaForCausalLM", BAMBA_KW, path, seed, overrides)


def make_tiny_mamba2(path, seed: int = 0, **overrides) -> Path:
    return _build("Mamba2Config", "Mamba2ForCausalLM", MAMBA2_KW, path, seed, overrides)


MAKERS = {
    "FalconH1ForCausalLM": make_tiny_falcon_h1,
    "GraniteMoeHybridForCausalLM": make_tiny_granite_moe_hybrid,
    "BambaForCausalLM": make_tiny_bamba,
    "Mamba2ForCausalLM": make_tiny_mamba2,
}


def rewrite_config_hub_style(path) -> Path:
    """Rewrite a saved config.json in the spellings published checkpoints use (transformers 4.x
    era): top-level `rope_theta` (and `partial_rotary_factor`) instead of `rope_parameters`,
    GraniteMoeHybrid `layer_types` as "mamba" / "attention", `time_step_limit` with a bare
    Infinity. transformers loads both spellings to the same model; a loader must too."""
    file = Path(path) / "config.json"
    raw = json.loads(file.read_text())
    rope = raw.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        raw["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope and raw.get("model_type") != "bamba":
        raw["partial_rotary_factor"] = rope["partial_rotary_factor"]  # bamba forces 0.5 itself
    if raw.get("model_type") == "granitemoehybrid":
        legacy = {"linear_attention": "mamba", "full_attention": "attention"}
        raw["layer_types"] = [legacy.get(t, t) for t in raw["layer_types"]]
    limit = raw.get("time_step_limit")
    if limit:  # {"__float__": "Infinity"} -> a bare Infinity (Python's json writes and reads it)
        raw["time_step_limit"] = [float(v["__float__"]) if isinstance(v, dict) else v
                                  for v in limit]
    file.write_text(json.dumps(raw, indent=2))
    return Path(path)


def load_hf(path):
    """transformers' model for a checkpoint folder, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()


def _model(path_or_model):
    return path_or_model if isinstance(path_or_model, torch.nn.Module) else load_hf(path_or_model)


@torch.no_grad()
def hf_logits(path_or_model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of one full forward (no cache), multipliers included."""
    return _model(path_or_model)(torch.tensor([list(token_ids)]), use_cache=False).logits[0].float()


def hf_prompt_logprobs(path_or_model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1] float32: log_softmax(logits[:-1]) at ids[1:] (transformers' full prefill)."""
    ids = list(token_ids)
    lp = torch.log_softmax(hf_logits(path_or_model, ids)[:-1], dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@torch.no_grad()
def hf_greedy(path_or_model, token_ids: list[int], n: int) -> list[int]:
    """n greedy tokens from `model.generate` (one prefill, then single-token steps through the
    cache, as transformers decodes), EOS ignored so exactly n come back. generate is used, not a
    hand loop, because it passes position_ids (BambaModel without them restarts RoPE at 0)."""
    from transformers import GenerationConfig

    model = _model(path_or_model)
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=0, use_cache=True)
    ids = torch.tensor([list(token_ids)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == n, f"generate returned {len(new)} tokens, wanted {n}"
    return new
