"""GraniteMoeHybrid's config reader: the keys transformers writes (and the older hub spellings)
onto ModelConfig fields. Configs come from transformers' own config class (no model built)."""

import json
import math

import pytest
import transformers
from family_checkpoints import GRANITE_KW, rewrite_config_hub_style

from mambaserve.config import ModelConfig
from mambaserve.model_layout import FFNKind, LayerSpec


def raw_config(**overrides) -> dict:
    """config.json as transformers writes it (JSON round trip: __float__ for infinity)."""
    cfg = transformers.GraniteMoeHybridConfig(**{**GRANITE_KW, **overrides})
    return json.loads(cfg.to_json_string())


def test_moe_config_fields():
    cfg = ModelConfig.from_dict(raw_config())  # no "architectures": found by model_type
    assert cfg.architecture == "GraniteMoeHybridForCausalLM"
    M, A = (LayerSpec(mamba=True, ffn=FFNKind.MOE), LayerSpec(attention=True, ffn=FFNKind.MOE))
    assert cfg.layers == (M, A, M, M)
    assert cfg.moe_router == "softmax_topk"
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (4, 2)
    # intermediate_size is ONE expert's size; the shared MLP has its own key
    assert (cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size) == (32, 48)
    assert cfg.head_dim == 16 and cfg.attention_scale == 0.2  # attention_multiplier, not 16**-.5
    assert cfg.rope_theta is None  # "nope": no positional encoding at all
    assert (cfg.embedding_multiplier, cfg.residual_multiplier) == (0.6, 0.7)
    assert cfg.logits_multiplier == 1 / 2.5
    assert cfg.norm_eps == 1e-5 and cfg.tie_word_embeddings
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size) == (
        8, 16, 2, 16)
    assert cfg.mamba_norm == "gate_then_norm" and not cfg.mamba_in_proj_bias
    assert cfg.prefill_dt_limit == (0.0, math.inf) and cfg.decode_dt_limit == (0.0, math.inf)
    assert cfg.time_step_min == 0.0


def test_dense_model_is_the_shared_mlp():
    cfg = ModelConfig.from_dict(raw_config(num_local_experts=0))
    assert {spec.ffn for spec in cfg.layers} == {FFNKind.SWIGLU} and not cfg.has_moe
    assert cfg.intermediate_size == 48 and cfg.n_routed_experts == 0


def test_rope_and_unsupported_rope_types():
    cfg = ModelConfig.from_dict(raw_config(position_embedding_type="rope"))
    assert cfg.rope_theta == 1000.0 and cfg.rotary_dim == cfg.head_dim == 16
    yarn = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 2.0,
            "original_max_position_embeddings": 256}
    raw = {**raw_config(position_embedding_type="rope"), "rope_parameters": yarn}
    with pytest.raises(ValueError, match="RoPE"):
        ModelConfig.from_dict(raw)
    # without "rope" transformers builds no rotary embedding, whatever rope_parameters say
    assert ModelConfig.from_dict({**raw_config(), "rope_parameters": yarn}).rope_theta is None


@pytest.mark.parametrize("key", ["layer_types", "layers_block_type"])
@pytest.mark.parametrize("names", [("mamba", "attention"), ("linear_attention", "full_attention")])
def test_layer_type_spellings_and_keys(key, names):
    raw = raw_config()
    del raw["layer_types"]
    m, a = names
    raw[key] = [m, a, a, m]
    assert [(s.mamba, s.attention) for s in ModelConfig.from_dict(raw).layers] == [
        (True, False), (False, True), (False, True), (True, False)]


def test_bad_layer_types_raise():
    raw = raw_config()
    with pytest.raises(ValueError, match="unknown GraniteMoeHybrid layer types"):
        ModelConfig.from_dict({**raw, "layer_types": ["mamba", "moe", "mamba", "mamba"]})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_dict({**raw, "layer_types": ["mamba"] * 3})


def test_hub_style_config_reads_the_same(tmp_path):
    for kw in ({}, {"position_embedding_type": "rope"}):
        transformers.GraniteMoeHybridConfig(**{**GRANITE_KW, **kw}).save_pretrained(tmp_path)
        new = ModelConfig.from_hf(tmp_path)
        raw = json.loads(rewrite_config_hub_style(tmp_path).joinpath("config.json").read_text())
        assert raw["layer_types"][:2] == ["mamba", "attention"]
        assert ModelConfig.from_hf(tmp_path) == new


def test_missing_keys_take_transformers_defaults():
    raw = {"architectures": ["GraniteMoeHybridForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "mamba_n_heads": 8,
           "vocab_size": 320}
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layers == (LayerSpec(mamba=True, ffn=FFNKind.MOE),) * 2  # all Mamba
    assert cfg.norm_eps == 1e-6 and not cfg.tie_word_embeddings
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.moe_intermediate_size == 11008 and cfg.moe_shared_expert_intermediate_size == 1024
    assert cfg.attention_scale == cfg.embedding_multiplier == cfg.logits_multiplier == 1.0
    assert cfg.mamba_head_dim == 16  # "auto": expand * hidden / heads
    assert cfg.num_kv_heads == 4 and cfg.rope_theta is None
