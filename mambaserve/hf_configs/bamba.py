"""Bamba (`BambaForCausalLM`): `attn_layer_indices` picks the attention layers, the rest are
Mamba2; every layer has a SwiGLU MLP. RoPE covers the first head_dim * partial_rotary_factor
channels: transformers' BambaConfig forces that factor to 0.5 (overriding a top-level key),
only a value inside `rope_parameters` survives."""

from __future__ import annotations

from typing import Any

from mambaserve.hf_configs.common import getter, mamba_fields, rope_theta, token_fields
from mambaserve.model_layout import FFNKind, LayerSpec


def read(raw: dict[str, Any]) -> dict[str, Any]:
    get = getter(raw)
    H = int(get("hidden_size"))
    n_layers = int(get("num_hidden_layers"))
    attn = set(get("attn_layer_indices", default=[]))
    n_heads = int(get("num_attention_heads", default=32))
    head_dim = int(get("head_dim", default=H // n_heads))
    d_inner = int(get("mamba_expand", default=2)) * H
    partial = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    proj_bias = bool(get("mamba_proj_bias", default=False))
    return dict(
        layers=tuple(LayerSpec(mamba=i not in attn, attention=i in attn, ffn=FFNKind.SWIGLU)
                     for i in range(n_layers)),
        vocab_size=int(get("vocab_size")), hidden_size=H,
        norm_eps=float(get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        num_attention_heads=n_heads,
        num_kv_heads=int(get("num_key_value_heads", default=n_heads)), head_dim=head_dim,
        max_position_embeddings=int(get("max_position_embeddings", default=262144)),
        intermediate_size=int(get("intermediate_size")),
        mlp_bias=bool(get("mlp_bias", default=False)),
        **mamba_fields(raw, d_inner, "mamba_expand * hidden_size"),
        mamba_in_proj_bias=proj_bias, mamba_out_proj_bias=proj_bias,
        attention_bias=bool(get("attention_bias", default=False)),
        rope_theta=rope_theta(raw), rotary_dim=int(head_dim * partial),
        **token_fields(raw),
    )
