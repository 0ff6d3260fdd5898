"""Checkpoint tensor names of each family onto the shared decoder's parameters."""

from mambaserve.models import bamba, mamba2


def test_mamba2_names_including_the_legacy_embedding():
    m = mamba2.checkpoint_name_to_param
    assert m("backbone.embeddings.weight") == ("embed_tokens.weight", None)
    assert m("backbone.embedding.weight") == ("embed_tokens.weight", None)
    assert m("backbone.layers.3.norm.weight") == ("layers.3.input_layernorm.weight", None)
    assert m("backbone.layers.3.mixer.norm.weight") == ("layers.3.mamba.norm_weight", None)
    assert m("backbone.layers.0.mixer.conv1d.weight") == ("layers.0.mamba.conv_weight", None)
    assert m("backbone.layers.0.mixer.A_log") == ("layers.0.mamba.A_log", None)
    assert m("backbone.norm_f.weight") == ("final_layernorm.weight", None)
    assert m("lm_head.weight") == ("lm_head.weight", None)


def test_bamba_gate_and_up_fill_the_two_halves():
    m = bamba.checkpoint_name_to_param
    assert m("model.layers.1.feed_forward.gate_proj.weight") == (
        "layers.1.feed_forward.gate_up_weight", 0)
    assert m("model.layers.1.feed_forward.up_proj.weight") == (
        "layers.1.feed_forward.gate_up_weight", 1)
    assert m("model.layers.1.feed_forward.down_proj.weight") == (
        "layers.1.feed_forward.down_proj.weight", None)
    assert m("model.layers.2.mamba.norm.weight") == ("layers.2.mamba.norm_weight", None)
    assert m("model.layers.2.input_layernorm.weight") == ("layers.2.input_layernorm.weight", None)
