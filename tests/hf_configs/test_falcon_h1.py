"""Falcon-H1's config.json reader (mambaserve/hf_configs/falcon_h1.py): the spellings of published
configs, FalconH1Config's class defaults for missing keys; the checkpoint name map; the mixer's
gated-norm variants bit for bit against transformers' FalconH1RMSNormGated in bfloat16."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from family_checkpoints import make_tiny_falcon_h1, rewrite_config_hub_style

from mambaserve.config import ModelConfig
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.model_layout import FFNKind, LayerSpec
from mambaserve.models.falcon_h1 import checkpoint_name_to_param

# Falcon-H1-0.5B-Instruct as published (families_spec.md §6; mamba_d_ssm = 24 * 64), with the
# legacy keys hub configs carry and the top-level rope_theta
PUBLISHED_05B = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
    "hidden_size": 1024, "num_hidden_layers": 36, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 2048, "vocab_size": 32784,
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 1e11,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64, "mamba_d_state": 128,
    "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 128,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "mamba_rms_norm": False,
    "mamba_norm_before_gate": False, "attn_layer_indices": None, "mamba_use_mlp": True,
    "num_logits_to_keep": 1, "projectors_bias": False,
    "embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
    "key_multiplier": 0.39062499999999994, "attention_in_multiplier": 1.0,
    "attention_out_multiplier": 0.9375, "ssm_in_multiplier": 1.25,
    "ssm_out_multiplier": 0.23570226039551587,
    "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
    "mlp_multipliers": [0.8838834764831844, 0.5859375],
    "time_step_limit": [0.0, math.inf], "eos_token_id": 11, "bos_token_id": 1,
    "pad_token_id": 0,
}


_DROP = object()  # a key to leave out of the config


def _cfg(**changes) -> ModelConfig:
    raw = {**PUBLISHED_05B, **changes}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not _DROP})


def test_published_05b_config():
    c = _cfg()
    assert c.architecture == "FalconH1ForCausalLM"
    assert c.layers == (LayerSpec(mamba=True, attention=True, ffn=FFNKind.SWIGLU),) * 36
    assert c.mamba_layer_ids == c.attention_layer_ids == list(range(36))
    assert (c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim) == (8, 2, 64, 64)
    assert (c.mamba_num_heads, c.mamba_head_dim, c.mamba_intermediate_size) == (24, 64, 1536)
    assert (c.ssm_state_size, c.n_groups, c.chunk_size) == (128, 1, 128)
    assert c.rope_theta == 1e11 and c.attention_scale is None
    assert c.mamba_norm == "none"
    assert c.prefill_dt_limit == (0.0, math.inf) and c.decode_dt_limit == (0.0, math.inf)
    assert c.time_step_min == 0.0
    assert c.embedding_multiplier == 5.656854249492381 and c.logits_multiplier == 0.0390625
    assert c.key_multiplier == 0.39062499999999994 and c.attention_out_multiplier == 0.9375
    assert (c.ssm_in_multiplier, c.ssm_out_multiplier) == (1.25, 0.23570226039551587)
    assert c.ssm_proj_multipliers == tuple(PUBLISHED_05B["ssm_multipliers"])
    assert (c.mlp_gate_multiplier, c.mlp_down_multiplier) == (0.8838834764831844, 0.5859375)
    assert c.residual_multiplier == 1.0 and not c.residual_in_fp32
    assert c.eos_token_ids == (11,) and c.torch_dtype == "bfloat16"


def test_rope_theta_top_level_or_in_rope_parameters():
    assert _cfg(rope_theta=_DROP).rope_theta == 10000.0  # the class default
    assert _cfg(rope_theta=_DROP, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 5e5}).rope_theta == 5e5
    with pytest.raises(ValueError, match="RoPE"):
        _cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_head_dim_key_wins_over_hidden_over_heads():
    # Falcon-H1-7B: head_dim 128 while hidden 3072 / 12 heads = 256
    c = _cfg(hidden_size=3072, num_attention_heads=12, head_dim=128)
    assert c.head_dim == c.rotary_dim == 128
    assert _cfg(head_dim=_DROP).head_dim == 1024 // 8


def test_mamba_d_ssm_missing_is_1024_and_null_is_expand_times_hidden():
    c = _cfg(mamba_d_ssm=_DROP, mamba_n_heads=16, mamba_d_head="auto")
    assert c.mamba_intermediate_size == 1024 and c.mamba_head_dim == 64
    c = _cfg(mamba_d_ssm=None, mamba_n_heads=32, mamba_d_head="auto")
    assert c.mamba_intermediate_size == 2 * 1024 and c.mamba_head_dim == 64
    with pytest.raises(ValueError, match="mamba_d_ssm"):
        _cfg(mamba_d_ssm=_DROP)  # 24 heads * 64 != 1024


def test_gated_norm_variants_and_bias_keys():
    assert _cfg(mamba_rms_norm=True).mamba_norm == "gate_then_norm"
    assert _cfg(mamba_rms_norm=True, mamba_norm_before_gate=True).mamba_norm == "norm_then_gate"
    # class defaults: no norm; with the norm, norm before gate
    assert _cfg(mamba_rms_norm=_DROP).mamba_norm == "none"
    assert _cfg(mamba_rms_norm=True, mamba_norm_before_gate=_DROP).mamba_norm == "norm_then_gate"
    c = _cfg(mamba_proj_bias=True)
    assert c.mamba_in_proj_bias and not c.mamba_out_proj_bias
    c = _cfg(projectors_bias=True)  # out_proj's bias, despite the name
    assert c.mamba_out_proj_bias and not c.mamba_in_proj_bias and not c.attention_bias


def test_class_defaults_for_missing_keys():
    c = _cfg(num_key_value_heads=_DROP, eos_token_id=_DROP, ssm_multipliers=_DROP,
             mlp_multipliers=_DROP, time_step_limit=_DROP, max_position_embeddings=_DROP)
    assert c.num_kv_heads == 8 and c.eos_token_ids == (2,)
    assert c.ssm_proj_multipliers == (1.0,) * 5
    assert (c.mlp_gate_multiplier, c.mlp_down_multiplier) == (1.0, 1.0)
    assert c.prefill_dt_limit == (0.0, math.inf) and c.max_position_embeddings == 8192
    assert _cfg(num_attention_heads=16, num_key_value_heads=_DROP).num_kv_heads == 8
    assert _cfg(num_attention_heads=16, num_key_value_heads=None).num_kv_heads == 16  # null
    assert _cfg(eos_token_id=[228, 11]).eos_token_ids == (228, 11)  # Falcon-H1-Tiny


def test_time_step_limit_spellings_and_model_type_only():
    for limit in ([0.05, {"__float__": "Infinity"}], [0.05, "Infinity"], [0.05, math.inf]):
        c = _cfg(time_step_limit=limit)
        assert c.prefill_dt_limit == (0.05, math.inf) and c.decode_dt_limit == (0.0, math.inf)
    assert _cfg(architectures=_DROP).architecture == "FalconH1ForCausalLM"


def test_attn_layer_indices_ignored_and_unsupported_activation():
    assert _cfg(attn_layer_indices=[3, 7]).attention_layer_ids == list(range(36))
    with pytest.raises(ValueError, match="hidden_act"):
        _cfg(hidden_act="gelu")


def test_saved_config_reads_the_same_in_hub_style(tmp_path):
    path = make_tiny_falcon_h1(tmp_path / "ckpt", seed=0)
    saved = ModelConfig.from_hf(path)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    rewrite_config_hub_style(path)
    hub = json.loads((path / "config.json").read_text())
    assert "rope_parameters" not in hub and hub["rope_theta"] == 1000.0
    assert ModelConfig.from_hf(path) == saved
    assert (saved.head_dim, saved.mamba_intermediate_size, saved.mamba_norm) == \
        (24, 96, "gate_then_norm")
    assert saved.ssm_proj_multipliers == (0.5, 1.5, 0.75, 1.25, 0.6)


def test_checkpoint_names():
    m = checkpoint_name_to_param
    assert m("model.embed_tokens.weight") == ("embed_tokens.weight", None)
    assert m("model.final_layernorm.weight") == ("final_layernorm.weight", None)
    assert m("lm_head.weight") == ("lm_head.weight", None)
    assert m("model.layers.2.feed_forward.gate_proj.weight") == (
        "layers.2.feed_forward.gate_up_weight", 0)
    assert m("model.layers.2.feed_forward.up_proj.bias") == (
        "layers.2.feed_forward.gate_up_bias", 1)
    assert m("model.layers.0.mamba.conv1d.weight") == ("layers.0.mamba.conv_weight", None)
    assert m("model.layers.0.mamba.norm.weight") == ("layers.0.mamba.norm_weight", None)
    assert m("model.layers.0.mamba.out_proj.bias") == ("layers.0.mamba.out_proj.bias", None)
    assert m("model.layers.1.self_attn.k_proj.weight") == ("layers.1.self_attn.k_proj.weight",
                                                           None)
    assert m("model.layers.1.pre_ff_layernorm.weight") == ("layers.1.pre_ff_layernorm.weight",
                                                           None)


@pytest.mark.parametrize("rms_norm,before_gate", [(True, False), (True, True), (False, False)])
def test_gated_norm_matches_transformers_in_bf16(rms_norm, before_gate):
    """Falcon multiplies by the norm weight in float32 before the cast (other families cast
    first): only bf16 shows it. Inputs in bf16, as in transformers' one-token path."""
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    from mambaserve.models.falcon_h1 import FalconH1ForCausalLM

    cfg = _cfg(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, head_dim=16,
               intermediate_size=32, vocab_size=64, mamba_d_ssm=96, mamba_n_heads=6,
               mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_rms_norm=rms_norm,
               mamba_norm_before_gate=before_gate)
    mixer = FalconH1ForCausalLM(cfg).layers[0].mamba
    assert isinstance(mixer, Mamba2Mixer) and mixer.norm_weight_fp32
    g = torch.Generator().manual_seed(0)
    y, z = (torch.randn(7, 96, generator=g).to(torch.bfloat16) for _ in range(2))
    if rms_norm:
        ref = FalconH1RMSNormGated(96, eps=1e-5, n_groups=2, norm_before_gate=before_gate)
        with torch.no_grad():
            w = (0.6 + 0.8 * torch.rand(96, generator=g)).to(torch.bfloat16)
            ref.weight.data = w
            mixer.norm_weight.data = w
        expected = ref(y, z)
    else:
        expected = y * F.silu(z)  # transformers' one-token path without the norm
    got = mixer._gated_norm(y, z)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
