"""The families' multipliers folded into the weights at load time (`fold_multipliers`): every
folded parameter is the unfolded one times its multipliers (float32, one cast back), the folded
forward runs no multiply by any multiplier and computes the unfolded forward's logits, tied
heads stay tied. The unfolded model (`load_model(..., fold_multipliers=False)`) is the
reference; the family parity tests check the folded one against transformers."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import (
    FALCON_H1_BIASES,
    FALCON_H1_NO_MAMBA_NORM,
    GRANITE_DENSE,
    make_tiny_falcon_h1,
    make_tiny_granite_moe_hybrid,
)
from torch.utils._python_dispatch import TorchDispatchMode

from mambaserve.config import ModelConfig
from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.models.hybrid import Multipliers
from mambaserve.models.loader import load_model

PAGE, PAGES, SLOTS = 4, 16, 4

CASES = {
    "falcon_h1_biases": (make_tiny_falcon_h1, {"seed": 3, **FALCON_H1_BIASES}),
    # tied head: lm_head_multiplier / embedding_multiplier go to the final norm
    "falcon_h1_tied": (make_tiny_falcon_h1, {"seed": 1, **FALCON_H1_NO_MAMBA_NORM,
                                             "tie_word_embeddings": True}),
    "granite_moe": (make_tiny_granite_moe_hybrid, {"seed": 0}),  # tied, experts + shared MLP
    "granite_dense": (make_tiny_granite_moe_hybrid, {"seed": 1, **GRANITE_DENSE,
                                                     "tie_word_embeddings": False}),
}


@pytest.fixture(scope="module", params=list(CASES))
def ckpt(request, tmp_path_factory):
    maker, kw = CASES[request.param]
    return maker(tmp_path_factory.mktemp(request.param) / "ckpt", **kw)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _expected_factors(cfg: ModelConfig, name: str, shape, dtype, tied: bool):
    """The float64 factor (a number, or one per row) a parameter was scaled by, derived from
    the config alone (how transformers applies each multiplier)."""
    r = cfg.residual_multiplier
    leaf = name.rsplit(".", 1)[-1]
    if name == "embed_tokens.weight":
        return cfg.embedding_multiplier
    if name == "lm_head.weight":
        return cfg.logits_multiplier
    if name == "final_layernorm.weight":
        return cfg.logits_multiplier / cfg.embedding_multiplier if tied else 1.0
    if ".mamba.in_proj." in name:
        d, gn, h = cfg.mamba_intermediate_size, cfg.n_groups * cfg.ssm_state_size, \
            cfg.mamba_num_heads
        # transformers' mup_vector is a buffer in the model dtype: the segments are rounded
        segs = [torch.tensor(m, dtype=dtype).item() for m in cfg.ssm_proj_multipliers]
        rows = torch.cat([torch.full((n,), m, dtype=torch.float64)
                          for n, m in zip((d, d, gn, gn, h), segs)])
        return rows * cfg.ssm_in_multiplier if leaf == "weight" else rows
    if ".mamba.out_proj." in name:
        return cfg.ssm_out_multiplier * r
    if ".self_attn." in name:
        a_in = cfg.attention_in_multiplier if leaf == "weight" else 1.0
        if ".q_proj." in name or ".v_proj." in name:
            return a_in
        if ".k_proj." in name:
            return cfg.key_multiplier * a_in
        if ".o_proj." in name:
            return cfg.attention_out_multiplier * r
    if name.endswith(("feed_forward.gate_up_weight", "feed_forward.gate_up_bias")):
        rows = torch.ones(shape[:2], dtype=torch.float64)
        rows[0] = cfg.mlp_gate_multiplier
        return rows
    if name.endswith(("feed_forward.down_proj.weight", "feed_forward.down_proj.bias")):
        return cfg.mlp_down_multiplier * r
    if name.endswith(("experts_down", "shared_experts.down_proj.weight")):
        return r
    return 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_parameters_are_weight_times_multiplier(ckpt, dtype):
    cfg = ModelConfig.from_hf(ckpt)
    plain = load_model(ckpt, dtype, "cpu", cfg, fold_multipliers=False)
    folded = load_model(ckpt, dtype, "cpu", cfg)
    tied = folded.lm_head.weight is folded.embed_tokens.weight
    assert tied == (plain.lm_head.weight is plain.embed_tokens.weight)
    assert tied == cfg.tie_word_embeddings  # the tie survives the folding
    before = dict(plain.named_parameters())
    changed = 0
    for name, p in folded.named_parameters():
        factor = torch.as_tensor(_expected_factors(cfg, name, p.shape, dtype, tied),
                                 dtype=torch.float64)
        f32 = factor.float().reshape(*factor.shape, *([1] * (p.ndim - factor.ndim)))
        want = (before[name].float() * f32).to(p.dtype)
        assert torch.equal(p, want), name
        changed += int(not torch.equal(p, before[name]))
    assert changed >= 2 * cfg.num_layers  # it folded something in every layer
    assert folded.multipliers == Multipliers()  # the forward's own multiplies are gone
    for m in folded.modules():
        assert getattr(m, "key_multiplier", 1.0) == 1.0
        assert getattr(m, "proj_multipliers", []) == []
        assert getattr(m, "gate_multiplier", 1.0) == getattr(m, "down_multiplier", 1.0) == 1.0


class MultiplierMuls(TorchDispatchMode):
    """Records every multiply by a number equal (in float32) to one of `values`."""

    def __init__(self, values) -> None:
        super().__init__()
        self.values = {_f32(v) for v in values if v != 1.0}
        self.hits: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("mul", "div")):
            for a in args:
                v = a.item() if isinstance(a, torch.Tensor) and a.numel() == 1 else a
                if isinstance(v, float) and _f32(v) in self.values:
                    self.hits.append((func.__name__, v))
        return func(*args, **(kwargs or {}))


def _two_steps(model, cfg):
    """A prefill step (a whole prompt and a first chunk), then a mixed step (one decode row,
    the rest of the chunked prompt): the logits of both."""
    mixer = next(m for m in model.modules() if type(m).__name__ == "Mamba2Mixer")
    attn = next(m for m in model.modules() if type(m).__name__ == "Attention")
    conv = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, cfg.conv_kernel - 1, mixer.conv_dim)
    ssm = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, mixer.num_heads, mixer.head_dim,
                      mixer.state_size)
    kv = torch.zeros(len(cfg.attention_layer_ids), 2, PAGES + 1, PAGE, attn.num_kv_heads,
                     attn.head_dim)

    def meta(prefills, decodes):
        return build_metadata(Batch(prefills, decodes), chunk_size=cfg.chunk_size,
                              conv_kernel=cfg.conv_kernel, page_size=PAGE, scratch_page=PAGES,
                              device="cpu")

    g = torch.Generator().manual_seed(7)
    a = torch.randint(3, cfg.vocab_size, (13,), generator=g).tolist()
    b = torch.randint(3, cfg.vocab_size, (19,), generator=g).tolist()
    pa, pb = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        out1 = model(meta([Row.standalone(a, 0, 0, False, pa),
                           Row.standalone(b[:7], 0, 1, False, pb)], []), conv, ssm, kv)
        out2 = model(meta([Row.standalone(b[7:], 7, 1, True, pb)],
                          [Row.standalone([a[-1]], len(a), 0, True, pa)]), conv, ssm, kv)
    return torch.cat([out1, out2])


def test_folded_forward_multiplies_by_no_multiplier(ckpt):
    cfg = ModelConfig.from_hf(ckpt)
    values = [cfg.embedding_multiplier, cfg.logits_multiplier, cfg.residual_multiplier,
              cfg.attention_in_multiplier, cfg.attention_out_multiplier, cfg.key_multiplier,
              cfg.ssm_in_multiplier, cfg.ssm_out_multiplier, *cfg.ssm_proj_multipliers,
              cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier]
    plain = load_model(ckpt, torch.float32, "cpu", cfg, fold_multipliers=False)
    folded = load_model(ckpt, torch.float32, "cpu", cfg)
    with MultiplierMuls(values) as seen_plain:
        want = _two_steps(plain, cfg)
    with MultiplierMuls(values) as seen_folded:
        got = _two_steps(folded, cfg)
    assert len(seen_plain.hits) >= 2 * cfg.num_layers  # the detector sees the unfolded ones
    assert seen_folded.hits == []
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
