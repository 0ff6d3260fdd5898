"""Tensor-parallel forward on 2 gloo ranks against the one-rank model: the tiny NemotronH (every
layer kind; its MoE layer stays replicated) loaded whole, sharded, and run over the engine's
metadata for a prefill step and a mixed step (one row decoding, one finishing a chunked
prefill). Each rank computes the unsharded logits first, then the sharded ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.sharding import shard_model
from mambaserve.distributed.spawn import run_on_ranks

PAGE, PAGES, SLOTS = 4, 16, 4


def _pools(model, cfg):
    """Zeroed state / KV pools at this rank's (possibly sharded) layer sizes."""
    mixer = next(m for m in model.modules() if type(m).__name__ == "Mamba2Mixer")
    attn = next(m for m in model.modules() if type(m).__name__ == "Attention")
    conv = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, cfg.conv_kernel - 1, mixer.conv_dim)
    ssm = torch.zeros(len(cfg.mamba_layer_ids), SLOTS + 1, mixer.num_heads, mixer.head_dim,
                      mixer.state_size)
    kv = torch.zeros(len(cfg.attention_layer_ids), 2, PAGES + 1, PAGE, attn.num_kv_heads,
                     attn.head_dim)
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


def _rank(tp: TPGroup, path: str) -> dict:
    from mambaserve.config import ModelConfig
    from mambaserve.models.loader import load_model

    torch.set_num_threads(1)
    cfg = ModelConfig.from_hf(Path(path))
    model = load_model(path, torch.float32, "cpu", cfg)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(3, 320, (13,), generator=g).tolist()
    b = torch.randint(3, 320, (19,), generator=g).tolist()
    whole = _two_steps(model, cfg, a, b)
    shard_model(model, tp)
    sharded = _two_steps(model, cfg, a, b)
    sizes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {"whole": whole, "sharded": sharded, "sizes": sizes}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", seed=3)


def test_tp2_logits_match_one_rank(ckpt):
    outs = run_on_ranks(_rank, 2, str(ckpt), timeout_s=90)
    _assert_exact(outs)
    # each rank holds its half of the heads / vocabulary
    s = outs[0]["sizes"]
    assert s["embeddings.weight"] == (160, 64) and s["lm_head.weight"] == (160, 64)
    assert s["layers.0.mixer.A_log"] == (4,)
    assert s["layers.0.mixer.in_proj.weight"] == (2 * 64 + 2 * 16 + 4, 64)
    assert s["layers.3.mixer.k_proj.weight"] == (16, 64)


def test_tp4_replicates_kv_heads(tmp_path):
    """tp 4 > num_kv_heads 2: ranks 0, 1 hold KV head 0 and ranks 2, 3 KV head 1."""
    path = make_tiny_checkpoint(tmp_path / "ck", seed=4, n_groups=4,
                                layers=["linear_attention", "full_attention", "mlp"])
    outs = run_on_ranks(_rank, 4, str(path), timeout_s=120)
    _assert_exact(outs)
    s = outs[3]["sizes"]
    assert s["layers.1.mixer.q_proj.weight"] == (16, 64)
    assert s["layers.1.mixer.k_proj.weight"] == (16, 64)
    assert s["layers.0.mixer.in_proj.weight"] == (2 * 32 + 2 * 16 + 2, 64)


def _assert_exact(outs):
    for out in outs:
        for whole, sharded in zip(out["whole"], out["sharded"]):
            assert whole.shape == sharded.shape and whole.shape[-1] == 320
            torch.testing.assert_close(sharded, whole, rtol=0, atol=1e-5)
