"""Falcon-H1 (`FalconH1ForCausalLM`, tiiuae Falcon-H1 / Falcon-H1R): every layer runs attention
and a Mamba2 mixer in parallel on the same normed input (summed), then a SwiGLU MLP; muP-style
multipliers everywhere.

As transformers' FalconH1Config reads a config.json (its class defaults fill missing keys):
- `head_dim` is the attention head dim when present (7B: 128, not hidden / heads = 256);
- the Mamba inner size is `mamba_d_ssm`: a missing key means the class default 1024, only an
  explicit null means mamba_expand * hidden_size; `mamba_d_head` may be "auto" (d_ssm / heads);
- the mixer's gated norm: none unless `mamba_rms_norm` (class default False), then
  norm-before-gate unless `mamba_norm_before_gate` is false (class default True; published
  checkpoints with the norm set it false);
- in_proj bias = `mamba_proj_bias`, out_proj bias = `projectors_bias`;
- dt is clamped to `time_step_limit` in multi-token forwards only (never a `time_step_min`);
- no layer-kind keys: `attn_layer_indices` / `mamba_use_mlp` in hub configs are ignored, as
  transformers ignores them;
- `num_key_value_heads` missing means 8, null means num_attention_heads;
- eos / bos / pad default to 2 / 1 / 0 when the keys are missing.
"""

from __future__ import annotations

from typing import Any

from mambaserve.hf_configs.common import getter, mamba_fields, rope_theta, token_fields
from mambaserve.model_layout import FFNKind, LayerSpec

# FalconH1Config's class defaults for keys whose absence is not "null"
_TOKEN_DEFAULTS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def read(raw: dict[str, Any]) -> dict[str, Any]:
    get = getter(raw)
    act = get("hidden_act", default="silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (the conv and the MLP use silu)")
    H = int(get("hidden_size", default=4096))
    n_layers = int(get("num_hidden_layers", default=32))
    n_heads = int(get("num_attention_heads", default=32))
    n_kv = raw.get("num_key_value_heads", 8)
    n_kv = n_heads if n_kv is None else int(n_kv)
    head_dim = int(get("head_dim", default=H // n_heads))

    d_ssm = raw.get("mamba_d_ssm", 1024)  # missing: the class default; null: expand * hidden
    d_ssm = int(get("mamba_expand", default=2)) * H if d_ssm is None else int(d_ssm)

    if not get("mamba_rms_norm", default=False):
        mamba_norm = "none"
    elif get("mamba_norm_before_gate", default=True):
        mamba_norm = "norm_then_gate"
    else:
        mamba_norm = "gate_then_norm"

    ssm_mult = tuple(float(m) for m in get("ssm_multipliers", default=[1.0] * 5))
    mlp_mult = tuple(float(m) for m in get("mlp_multipliers", default=[1.0, 1.0]))
    if len(ssm_mult) != 5 or len(mlp_mult) != 2:
        raise ValueError(f"ssm_multipliers needs 5 values (z, x, B, C, dt) and mlp_multipliers 2 "
                         f"(gate, down); got {list(ssm_mult)} and {list(mlp_mult)}")
    return dict(
        layers=tuple(LayerSpec(mamba=True, attention=True, ffn=FFNKind.SWIGLU)
                     for _ in range(n_layers)),
        vocab_size=int(get("vocab_size", default=128000)), hidden_size=H,
        norm_eps=float(get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        num_attention_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        max_position_embeddings=int(get("max_position_embeddings", default=8192)),
        intermediate_size=int(get("intermediate_size", default=14336)),
        mlp_bias=bool(get("mlp_bias", default=False)),
        **mamba_fields(raw, d_ssm, "the Mamba inner size mamba_d_ssm"),
        mamba_in_proj_bias=bool(get("mamba_proj_bias", default=False)),
        mamba_out_proj_bias=bool(get("projectors_bias", default=False)),
        mamba_norm=mamba_norm, mamba_norm_weight_fp32=True,
        attention_bias=bool(get("attention_bias", default=False)),
        rope_theta=rope_theta(raw), rotary_dim=head_dim,
        embedding_multiplier=float(get("embedding_multiplier", default=1.0)),
        logits_multiplier=float(get("lm_head_multiplier", default=1.0)),
        attention_in_multiplier=float(get("attention_in_multiplier", default=1.0)),
        attention_out_multiplier=float(get("attention_out_multiplier", default=1.0)),
        key_multiplier=float(get("key_multiplier", default=1.0)),
        ssm_in_multiplier=float(get("ssm_in_multiplier", default=1.0)),
        ssm_out_multiplier=float(get("ssm_out_multiplier", default=1.0)),
        ssm_proj_multipliers=ssm_mult,
        mlp_gate_multiplier=mlp_mult[0], mlp_down_multiplier=mlp_mult[1],
        **token_fields({**_TOKEN_DEFAULTS, **raw}),
    )
