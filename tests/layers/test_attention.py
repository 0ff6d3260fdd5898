"""Attention.pack_qkv: q, k, v as one projection gives the three projections' outputs; FP8
projections stay separate; an engine-built model has packed layers."""

from __future__ import annotations

import dataclasses

import torch

from mambaserve.bench.presets import preset_config
from mambaserve.config import ModelConfig
from mambaserve.layers.attention import Attention


def _attention(bias: bool) -> Attention:
    cfg = dataclasses.replace(ModelConfig.from_dict(preset_config("tiny")), attention_bias=bias)
    torch.manual_seed(0)
    a = Attention(cfg)
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return a


def test_packed_projection_gives_the_three_outputs():
    for bias in (False, True):
        a = _attention(bias)
        x = torch.randn(5, a.q_proj.in_features)
        want = [t.clone() for t in a._qkv(x)]
        a.pack_qkv()
        assert a.qkv_proj is not None and not hasattr(a, "q_proj")
        assert (a.qkv_proj.bias is not None) == bias
        got = a._qkv(x)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        a.pack_qkv()  # a second call changes nothing
        assert a.qkv_proj.weight.shape[0] == (a.num_heads + 2 * a.num_kv_heads) * a.head_dim


def test_fp8_projections_stay_separate():
    a = _attention(False)
    a.k_proj = torch.nn.Sequential(a.k_proj)  # stands for any projection that is not nn.Linear
    a.pack_qkv()
    assert a.qkv_proj is None and hasattr(a, "q_proj")


def test_engine_packs_every_attention_layer(tiny_ckpt):
    from mambaserve.config import EngineConfig
    from mambaserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(tiny_ckpt, EngineConfig(device="cpu", dtype="float32"))
    layers = [m for m in eng.model.modules() if isinstance(m, Attention)]
    assert layers and all(m.qkv_proj is not None for m in layers)


def test_falcon_h1_layers_project_both_mixers_in_one_gemm_each_way(tmp_path):
    """An engine-built Falcon-H1 (attention and Mamba in every layer) packs each layer's in_proj
    and q / k / v into one projection, and o_proj and out_proj into one projection of both
    outputs side by side; its prompt logprobs equal transformers' (the parity tests cover every
    family and seed; this one checks the packing is in effect there)."""
    from family_checkpoints import hf_prompt_logprobs, make_tiny_falcon_h1

    from mambaserve import LLM, SamplingParams

    path = make_tiny_falcon_h1(tmp_path / "fh1", seed=3)
    llm = LLM(path, dtype="float32", device="cpu")
    layers = llm.engine.model.layers
    assert all(layer.mixer_in is not None and layer.mamba.in_proj is None for layer in layers)
    assert all(layer.mixer_out is not None and layer.self_attn.o_proj is None
               and layer.mamba.out_proj is None for layer in layers)
    ids = torch.randint(3, 100, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)])
    torch.testing.assert_close(got, hf_prompt_logprobs(path, ids), rtol=0, atol=1e-4)
