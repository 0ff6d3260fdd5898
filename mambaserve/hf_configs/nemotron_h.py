"""NemotronH (`NemotronHForCausalLM`, Nemotron-H / Nemotron-Nano-9B-v2 / Nemotron-3): one block
per layer, named by a pattern character ("M" Mamba2, "*" attention, "-" relu² MLP, "E" MoE).

Hub checkpoints write `hybrid_override_pattern`, transformers 5 writes `layers_block_type`; older
names such as `mamba_d_conv` are accepted too. transformers' NemotronH clamps prefill dt to
(time_step_min, inf) and leaves decode dt unclamped, ignoring `time_step_limit`'s lower bound; the
reader reproduces that (docs/architecture.md).
"""

from __future__ import annotations

import math
from typing import Any

from mambaserve.hf_configs.common import getter, time_step_limit, token_fields
from mambaserve.model_layout import LayerKind, LayerSpec

PATTERN_CHARS = {"M": LayerKind.MAMBA, "*": LayerKind.ATTENTION, "-": LayerKind.MLP,
                 "E": LayerKind.MOE}
_BLOCK_TYPE_NAMES = {
    "mamba": LayerKind.MAMBA, "linear_attention": LayerKind.MAMBA,
    "attention": LayerKind.ATTENTION, "full_attention": LayerKind.ATTENTION,
    "mlp": LayerKind.MLP, "moe": LayerKind.MOE,
}


def layer_kinds(raw: dict[str, Any]) -> tuple[LayerKind, ...]:
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
            return tuple(PATTERN_CHARS[c] for c in pattern)
        except KeyError as e:
            raise ValueError(f"unknown character {e.args[0]!r} in hybrid_override_pattern; "
                             f"known: {''.join(PATTERN_CHARS)}") from None
    raise ValueError("config.json has neither hybrid_override_pattern nor layers_block_type")


def read(raw: dict[str, Any]) -> dict[str, Any]:
    get = getter(raw)
    kinds = layer_kinds(raw)
    hidden = int(get("hidden_size"))
    n_heads = int(get("num_attention_heads", default=32))
    limit = time_step_limit(raw)
    time_step_min = float(get("time_step_min", "mamba_dt_min", default=0.001))
    use_bias = bool(get("use_bias", default=False))
    return dict(
        layer_kinds=kinds,
        layers=tuple(LayerSpec.of_kind(k) for k in kinds),
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
        mamba_in_proj_bias=use_bias, mamba_out_proj_bias=use_bias,
        time_step_min=time_step_min,
        time_step_limit=limit,
        # NOTE: transformers' NemotronH floors prefill dt at time_step_min, never clamps decode
        prefill_dt_limit=(time_step_min, limit[1]), decode_dt_limit=(0.0, math.inf),
        n_routed_experts=int(get("n_routed_experts", "num_local_experts", default=0)),
        num_experts_per_tok=int(get("num_experts_per_tok", default=0)),
        moe_intermediate_size=int(get("moe_intermediate_size", default=0)),
        moe_shared_expert_intermediate_size=int(
            get("moe_shared_expert_intermediate_size", default=0)),
        n_group=int(get("n_group", default=1)),
        topk_group=int(get("topk_group", default=1)),
        norm_topk_prob=bool(get("norm_topk_prob", default=True)),
        routed_scaling_factor=float(get("routed_scaling_factor", default=1.0)),
        **token_fields(raw),
        extra={"mamba_ssm_cache_dtype": get("mamba_ssm_cache_dtype", default="float32")},
    )
