"""Tensor-parallel forward against the one-rank model, for every family the engine serves: each
tiny checkpoint loaded whole, sharded, and run over the engine's metadata for a prefill step
(two rows, one a first chunk) and a mixed step (one row decoding, one finishing its chunked
prefill). Each rank computes the unsharded logits first, then the sharded ones; float32, within
1e-5. One spawn per tp size runs every case (process start-up dominates the cost).

The cases cover NemotronH with every layer kind (Mamba2, attention, MLP, MoE with the sigmoid
router, grouped or not), Falcon-H1 (attention and Mamba2 in parallel, every multiplier != 1,
both gate orders, biases), GraniteMoeHybrid (softmax top-k SwiGLU experts + shared MLP, and the
dense model), Bamba and Mamba2; n_groups 1 (the gated norm's one group spans the ranks; B / C
replicated), vocabularies tp does not divide (padded), tied and untied heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checkpoints import (
    FALCON_H1_BIASES,
    FALCON_H1_NORM_BEFORE_GATE,
    GRANITE_DENSE,
    make_tiny_bamba,
    make_tiny_falcon_h1,
    make_tiny_granite_moe_hybrid,
    make_tiny_mamba2,
)
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.sharding import shard_model
from mambaserve.distributed.spawn import run_on_ranks

PAGE, PAGES, SLOTS = 4, 16, 4

# name -> (checkpoint maker, its overrides)
TP2_CASES = {
    "nemotron_h": (make_tiny_checkpoint, {"seed": 3}),
    # one Mamba group over both ranks, router groups (2, top 1), vocab 317 (untied head),
    # MLP biases (the shared expert's bias added once, before the MoE's one all-reduce)
    "nemotron_h_g1": (make_tiny_checkpoint, {"seed": 5, "n_groups": 1, "n_group": 2,
                                             "topk_group": 1, "vocab_size": 317,
                                             "mlp_bias": True}),
    "falcon_h1_g1": (make_tiny_falcon_h1, {"seed": 0, "mamba_n_groups": 1}),
    "falcon_h1_norm_first_biases": (make_tiny_falcon_h1, {
        "seed": 1, "mamba_n_groups": 1, **FALCON_H1_NORM_BEFORE_GATE, **FALCON_H1_BIASES}),
    "granite_moe_g1": (make_tiny_granite_moe_hybrid, {"seed": 0, "mamba_n_groups": 1}),
    "granite_dense": (make_tiny_granite_moe_hybrid, {"seed": 1, **GRANITE_DENSE}),
    "bamba_g1": (make_tiny_bamba, {"seed": 0, "mamba_n_groups": 1}),
    # tied head, vocab 321
    "mamba2_g1": (make_tiny_mamba2, {"seed": 0, "n_groups": 1, "tie_word_embeddings": True,
                                     "vocab_size": 321}),
}
TP4_CASES = {
    # tp 4 > num_kv_heads 2 (KV heads replicated), groups split
    "nemotron_h_g4": (make_tiny_checkpoint, {
        "seed": 4, "n_groups": 4, "layers": ["linear_attention", "full_attention", "mlp"]}),
    # two norm groups, each over two ranks; MoE; vocab 318 padded to 320
    "nemotron_h_g2": (make_tiny_checkpoint, {
        "seed": 6, "n_groups": 2, "vocab_size": 318,
        "layers": ["linear_attention", "moe", "full_attention", "linear_attention"]}),
}


def _pools(model, cfg):
    """Zeroed state / KV pools at this rank's (possibly sharded) layer sizes."""
    mixer = next(m for m in model.modules() if type(m).__name__ == "Mamba2Mixer")
    attn = next((m for m in model.modules() if type(m).__name__ == "Attention"), None)
    conv = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, cfg.conv_kernel - 1, mixer.conv_dim)
    ssm = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, mixer.num_heads, mixer.head_dim,
                      mixer.state_size)
    kv = None if attn is None else torch.zeros(
        len(cfg.attention_layer_ids), 2, PAGES + 1, PAGE, attn.num_kv_heads, attn.head_dim)
    return conv, ssm, kv


def _two_steps(model, cfg, a: list[int], b: list[int]) -> list[torch.Tensor]:
    """Step 1: row A's whole prompt and B's first 7 tokens; step 2: A decodes one token, B
    prefills the rest. The logits of both steps."""
    from mambaserve.engine.batch import Batch, Row
    from mambaserve.metadata import build_metadata

    def meta(prefills, decodes):
        return build_metadata(Batch(prefills, decodes), chunk_size=cfg.chunk_size,
                              conv_kernel=cfg.conv_kernel, page_size=PAGE, scratch_page=PAGES,
                              device="cpu")

    pools = _pools(model, cfg)
    pa, pb = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        m1 = meta([Row.standalone(a, 0, 0, False, pa), Row.standalone(b[:7], 0, 1, False, pb)],
                  [])
        out1 = model(m1, *pools)
        m2 = meta([Row.standalone(b[7:], 7, 1, True, pb)],
                  [Row.standalone([a[-1]], len(a), 0, True, pa)])
        out2 = model(m2, *pools)
    return [out1, out2]


def _one_case(tp: TPGroup, path: str) -> dict:
    from mambaserve.config import ModelConfig
    from mambaserve.models.loader import load_model

    cfg = ModelConfig.from_hf(Path(path))
    model = load_model(path, torch.float32, "cpu", cfg)
    _nonzero_linear_biases(model)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(3, cfg.vocab_size, (13,), generator=g).tolist()
    b = torch.randint(3, cfg.vocab_size, (19,), generator=g).tolist()
    whole = _two_steps(model, cfg, a, b)
    shard_model(model, tp)
    sharded = _two_steps(model, cfg, a, b)
    sizes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"whole": whole, "sharded": sharded, "sizes": sizes, "vocab": cfg.vocab_size}


def _nonzero_linear_biases(model) -> None:
    """transformers initializes linear biases to zero, which would hide a bias added on every
    rank: redraw them (the same on every rank)."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _rank(tp: TPGroup, paths: dict[str, str]) -> dict[str, dict]:
    torch.set_num_threads(1)
    return {name: _one_case(tp, path) for name, path in paths.items()}


def _make(cases: dict, root: Path) -> dict[str, str]:
    out = {}
    for name, (maker, kw) in cases.items():
        out[name] = str(maker(root / name, **kw))
    return out


@pytest.fixture(scope="module")
def tp2_outs(tmp_path_factory) -> list[dict[str, dict]]:
    paths = _make(TP2_CASES, tmp_path_factory.mktemp("tp2"))
    return run_on_ranks(_rank, 2, paths, timeout_s=120)


@pytest.mark.parametrize("case", list(TP2_CASES))
def test_tp2_logits_match_one_rank(tp2_outs, case):
    _assert_exact([out[case] for out in tp2_outs])


def test_tp2_shard_sizes(tp2_outs):
    """Each rank holds its half of the heads, experts' columns and (padded) vocabulary."""
    s = tp2_outs[1]["nemotron_h"]["sizes"]
    assert s["embeddings.weight"] == (160, 64) and s["lm_head.weight"] == (160, 64)
    assert s["layers.0.mixer.A_log"] == (4,)
    assert s["layers.0.mixer.in_proj.weight"] == (2 * 64 + 2 * 16 + 4, 64)
    assert s["layers.3.mixer.k_proj.weight"] == (16, 64)
    assert s["layers.1.mixer.experts_up"] == (4, 16, 64)
    assert s["layers.1.mixer.experts_down"] == (4, 64, 16)
    assert s["layers.1.mixer.shared_experts.up_proj.weight"] == (24, 64)
    assert s["layers.1.mixer.gate.weight"] == (4, 64)  # the router stays whole
    g1 = tp2_outs[1]["nemotron_h_g1"]["sizes"]
    assert g1["embeddings.weight"] == (159, 64) and g1["lm_head.weight"] == (159, 64)
    # n_groups 1: the one B / C group replicated next to the rank's 4 heads
    assert g1["layers.0.mixer.in_proj.weight"] == (2 * 64 + 2 * 16 + 4, 64)
    gr = tp2_outs[0]["granite_moe_g1"]["sizes"]
    assert gr["layers.0.feed_forward.experts_gate_up"] == (4, 2 * 16, 64)
    assert gr["layers.0.feed_forward.experts_down"] == (4, 64, 16)
    assert gr["layers.0.feed_forward.shared_experts.gate_up_weight"] == (2, 24, 64)
    assert gr["layers.0.feed_forward.router.weight"] == (4, 64)
    m2 = tp2_outs[1]["mamba2_g1"]["sizes"]
    assert m2["embed_tokens.weight"] == (161, 64) and "lm_head.weight" not in m2  # tied


def test_tp4_logits_match_one_rank(tmp_path):
    paths = _make(TP4_CASES, tmp_path)
    outs = run_on_ranks(_rank, 4, paths, timeout_s=150)
    for case in TP4_CASES:
        _assert_exact([out[case] for out in outs])
    s = outs[3]["nemotron_h_g4"]["sizes"]
    assert s["layers.1.mixer.q_proj.weight"] == (16, 64)
    assert s["layers.1.mixer.k_proj.weight"] == (16, 64)
    assert s["layers.0.mixer.in_proj.weight"] == (2 * 32 + 2 * 16 + 2, 64)
    s = outs[3]["nemotron_h_g2"]["sizes"]
    assert s["embeddings.weight"] == (80, 64)
    assert s["layers.1.mixer.experts_up"] == (4, 8, 64)


def _assert_exact(outs):
    for out in outs:
        for whole, sharded in zip(out["whole"], out["sharded"]):
            assert whole.shape == sharded.shape and whole.shape[-1] == out["vocab"]
            torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-5)
