"""Mamba2 (`Mamba2ForCausalLM`: state-spaces mamba2-130m ... 2.7b, Mamba-Codestral-7B): Mamba2
layers only, no attention, no MLP.

As transformers runs it: `head_dim` is the SSM head dim; the gated norm always gates first
(w * norm(y * silu(z)), groups of d / n_groups), whatever `norm_before_gate` / `rms_norm` say in
config.json (transformers ignores both keys, and so do we); dt is clamped to `time_step_limit`
in multi-token forwards only, never floored at `time_step_min` (an init-time value);
`residual_in_fp32` keeps the residual stream in float32.
"""

from __future__ import annotations

import math
from typing import Any

from mambaserve.hf_configs.common import getter, time_step_limit, token_fields
from mambaserve.model_layout import LayerSpec

MAX_LEN_DEFAULT = 1 << 16  # an SSM has no position limit; the engine's default max_model_len


def read(raw: dict[str, Any]) -> dict[str, Any]:
    get = getter(raw)
    H = int(get("hidden_size"))
    heads, head_dim = int(get("num_heads", default=128)), int(get("head_dim", default=64))
    d_inner = int(get("expand", default=2)) * H
    if heads * head_dim != d_inner:
        raise ValueError(f"num_heads * head_dim = {heads * head_dim} differs from expand * "
                         f"hidden_size = {d_inner}")
    use_bias = bool(get("use_bias", default=False))
    limit = time_step_limit(raw)
    return dict(
        layers=tuple(LayerSpec(mamba=True) for _ in range(int(get("num_hidden_layers")))),
        vocab_size=int(get("vocab_size")), hidden_size=H,
        norm_eps=float(get("layer_norm_epsilon", default=1e-5)),
        tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
        # no attention layers: these sizes are never used
        num_attention_heads=1, num_kv_heads=1, head_dim=1,
        max_position_embeddings=int(get("max_position_embeddings", default=MAX_LEN_DEFAULT)),
        intermediate_size=0, mlp_bias=False,
        mamba_num_heads=heads, mamba_head_dim=head_dim,
        ssm_state_size=int(get("state_size", default=128)),
        n_groups=int(get("n_groups", default=8)),
        conv_kernel=int(get("conv_kernel", default=4)),
        chunk_size=int(get("chunk_size", default=256)),
        use_conv_bias=bool(get("use_conv_bias", default=True)),
        mamba_in_proj_bias=use_bias, mamba_out_proj_bias=use_bias,
        time_step_min=0.0, time_step_limit=limit,
        prefill_dt_limit=limit, decode_dt_limit=(0.0, math.inf),
        residual_in_fp32=bool(get("residual_in_fp32", default=True)),
        **token_fields(raw),
    )
