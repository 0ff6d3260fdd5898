"""GraniteMoeHybrid checkpoint names onto the shared decoder: the shared MLP is the whole FFN of an
expert-less model but the MoE's shared expert otherwise, so the map comes from the config."""

import json

import transformers
from family_checkpoints import GRANITE_KW

from mambaserve.config import ModelConfig
from mambaserve.models.registry import checkpoint_name_map


def name_map(**overrides):
    raw = json.loads(transformers.GraniteMoeHybridConfig(**{**GRANITE_KW, **overrides})
                     .to_json_string())
    return checkpoint_name_map(ModelConfig.from_dict(raw))


def test_moe_names():
    m = name_map()
    assert m("model.layers.0.shared_mlp.input_linear.weight") == (
        "layers.0.feed_forward.shared_experts.gate_up_weight", None)
    assert m("model.layers.0.shared_mlp.output_linear.weight") == (
        "layers.0.feed_forward.shared_experts.down_proj.weight", None)
    for name in ("router.layer.weight", "router.weight"):  # checkpoint / transformers 5 memory
        assert m(f"model.layers.2.block_sparse_moe.{name}") == (
            "layers.2.feed_forward.router.weight", None)
    for name in ("input_linear.weight", "experts.gate_up_proj"):
        assert m(f"model.layers.2.block_sparse_moe.{name}") == (
            "layers.2.feed_forward.experts_gate_up", None)
    for name in ("output_linear.weight", "experts.down_proj"):
        assert m(f"model.layers.2.block_sparse_moe.{name}") == (
            "layers.2.feed_forward.experts_down", None)


def test_names_common_to_dense_and_moe():
    dense = name_map(num_local_experts=0)
    assert dense("model.layers.3.shared_mlp.input_linear.weight") == (
        "layers.3.feed_forward.gate_up_weight", None)
    assert dense("model.layers.3.shared_mlp.output_linear.weight") == (
        "layers.3.feed_forward.down_proj.weight", None)
    for m in (dense, name_map()):
        assert m("model.norm.weight") == ("final_layernorm.weight", None)
        assert m("model.layers.1.post_attention_layernorm.weight") == (
            "layers.1.pre_ff_layernorm.weight", None)
        assert m("model.layers.1.input_layernorm.weight") == (
            "layers.1.input_layernorm.weight", None)
        assert m("model.layers.0.mamba.norm.weight") == ("layers.0.mamba.norm_weight", None)
        assert m("model.layers.0.mamba.conv1d.weight") == ("layers.0.mamba.conv_weight", None)
        assert m("model.layers.1.self_attn.q_proj.weight") == (
            "layers.1.self_attn.q_proj.weight", None)
        assert m("model.embed_tokens.weight") == ("embed_tokens.weight", None)
        assert m("lm_head.weight") == ("lm_head.weight", None)
