"""GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`, ibm-granite granite-4.0-h-*): each layer is a
Mamba2 mixer or an attention layer, then a feed-forward block: routed SwiGLU experts (softmax over
the top-k router logits) plus a shared SwiGLU MLP, or the shared MLP alone when
`num_local_experts` is 0 (granite-4.0-h-micro, -350m, -1b).

As transformers runs it: `intermediate_size` is the size of ONE expert and
`shared_intermediate_size` the shared MLP's (the dense FFN size of the expert-less models); the
attention softmax scale is `attention_multiplier`, not head_dim ** -0.5; there is no positional
encoding unless `position_embedding_type == "rope"` (published: "nope"); the embeddings are
multiplied by `embedding_multiplier`, every sub-block output by `residual_multiplier`, and the
logits divided by `logits_scaling`. Layer types are spelled mamba / attention (hub configs) or
linear_attention / full_attention (transformers 5), under `layer_types` or the older key
`layers_block_type`. Missing keys take transformers' class defaults (rms_norm_eps 1e-6, every
multiplier 1, 8 experts top-2, ...).
"""

from __future__ import annotations

from typing import Any

from mambaserve.hf_configs.common import getter, mamba_fields, rope_theta, token_fields
from mambaserve.model_layout import FFNKind, LayerSpec

_MAMBA = ("mamba", "linear_attention")
_ATTENTION = ("attention", "full_attention")


def layer_is_mamba(raw: dict[str, Any], n_layers: int) -> list[bool]:
    """Per layer: True for a Mamba2 layer, False for attention (no key: all Mamba, as in
    transformers)."""
    types = getter(raw)("layer_types", "layers_block_type")
    if types is None:
        return [True] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n_layers}")
    unknown = sorted({t for t in types if t not in _MAMBA + _ATTENTION})
    if unknown:
        raise ValueError(f"unknown GraniteMoeHybrid layer types {unknown}; expected one of "
                         f"{', '.join(_MAMBA + _ATTENTION)}")
    return [t in _MAMBA for t in types]


def read(raw: dict[str, Any]) -> dict[str, Any]:
    get = getter(raw)
    H = int(get("hidden_size", default=4096))
    n_layers = int(get("num_hidden_layers", default=32))
    is_mamba = layer_is_mamba(raw, n_layers)
    n_heads = int(get("num_attention_heads", default=32))
    head_dim = int(get("head_dim", default=H // n_heads))
    d_inner = int(get("mamba_expand", default=2)) * H

    experts = int(get("num_local_experts", default=8))
    top_k = int(get("num_experts_per_tok", default=2)) if experts else 0
    if experts and not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_local_experts={experts}")
    shared = int(get("shared_intermediate_size", default=1024))
    ffn = FFNKind.MOE if experts else FFNKind.SWIGLU

    # transformers builds a rotary embedding only for "rope"; anything else runs without one
    rope = get("position_embedding_type") == "rope"
    scaling = float(get("logits_scaling", default=1.0))
    if scaling == 0:
        raise ValueError("logits_scaling must be non-zero (the logits are divided by it)")
    proj_bias = bool(get("mamba_proj_bias", default=False))
    return dict(
        layers=tuple(LayerSpec(mamba=m, attention=not m, ffn=ffn) for m in is_mamba),
        vocab_size=int(get("vocab_size", default=32000)), hidden_size=H,
        norm_eps=float(get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        num_attention_heads=n_heads,
        num_kv_heads=int(get("num_key_value_heads", default=n_heads)), head_dim=head_dim,
        max_position_embeddings=int(get("max_position_embeddings", default=2048)),
        # the dense FFN (expert-less models) is the shared MLP
        intermediate_size=shared, mlp_bias=False,
        **mamba_fields(raw, d_inner, "mamba_expand * hidden_size"),
        mamba_in_proj_bias=proj_bias, mamba_out_proj_bias=proj_bias,
        attention_bias=bool(get("attention_bias", default=False)),
        attention_scale=float(get("attention_multiplier", default=1.0)),
        rope_theta=rope_theta(raw) if rope else None, rotary_dim=head_dim if rope else 0,
        moe_router="softmax_topk",
        n_routed_experts=experts, num_experts_per_tok=top_k,
        moe_intermediate_size=int(get("intermediate_size", default=11008)) if experts else 0,
        moe_shared_expert_intermediate_size=shared,
        embedding_multiplier=float(get("embedding_multiplier", default=1.0)),
        # NOTE: transformers divides by logits_scaling; the product with the reciprocal is
        # within one float32 ulp of it (and the same bf16 value for the published 3, 6, 8)
        logits_multiplier=1.0 / scaling,
        residual_multiplier=float(get("residual_multiplier", default=1.0)),
        **token_fields(raw),
    )
