import json
import math

import pytest

from mambaserve.config import LayerKind, ModelConfig

BASE = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 100,
    "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8,
    "n_groups": 2, "conv_kernel": 4, "chunk_size": 16, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "moe_shared_expert_intermediate_size": 16,
}


def write(tmp_path, **kw):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **kw}))
    return tmp_path


def test_hybrid_override_pattern(tmp_path):
    cfg = ModelConfig.from_hf(write(tmp_path, hybrid_override_pattern="M-M*E"))
    assert cfg.layer_kinds == (LayerKind.MAMBA, LayerKind.MLP, LayerKind.MAMBA,
                               LayerKind.ATTENTION, LayerKind.MOE)
    assert cfg.mamba_layer_ids == [0, 2] and cfg.attention_layer_ids == [3]
    assert cfg.pattern == "M-M*E"


def test_layers_block_type_and_infinity_encoding(tmp_path):
    cfg = ModelConfig.from_hf(write(
        tmp_path, layers_block_type=["linear_attention", "mlp", "full_attention", "moe"],
        time_step_limit=[0.0, {"__float__": "Infinity"}], time_step_min=0.002))
    assert cfg.pattern == "M-*E"
    assert cfg.time_step_limit == (0.0, math.inf)
    assert cfg.prefill_dt_limit == (0.002, math.inf)
    assert cfg.conv_dim == 4 * 8 + 2 * 2 * 8


def test_legacy_names(tmp_path):
    raw = {k: v for k, v in BASE.items() if k not in ("n_groups", "conv_kernel", "chunk_size")}
    (tmp_path / "config.json").write_text(json.dumps(
        {**raw, "hybrid_override_pattern": "M*", "mamba_n_groups": 4, "mamba_d_conv": 3,
         "mamba_chunk_size": 32}))
    cfg = ModelConfig.from_hf(tmp_path)
    assert (cfg.n_groups, cfg.conv_kernel, cfg.chunk_size) == (4, 3, 32)


def test_unsupported_architecture_names_supported(tmp_path):
    with pytest.raises(ValueError, match="supported: NemotronHForCausalLM"):
        ModelConfig.from_hf(write(tmp_path, architectures=["LlamaForCausalLM"],
                                  model_type="llama", hybrid_override_pattern="*"))


@pytest.mark.parametrize("bad, match", [
    ({"hybrid_override_pattern": "MX"}, "unknown character 'X'"),
    ({"layers_block_type": ["mamba", "conv"]}, "unknown layer type 'conv'"),
    ({}, "neither hybrid_override_pattern nor layers_block_type"),
    ({"hybrid_override_pattern": "M", "mamba_num_heads": 5}, "multiple of n_groups"),
])
def test_bad_configs(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(write(tmp_path, **bad))


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed config.json"):
        ModelConfig.from_hf(tmp_path)
