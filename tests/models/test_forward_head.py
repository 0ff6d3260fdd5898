"""A forward finished from its head (models/forward_head.py: the embedding, the first layer's norm
and first projection, computed apart) is the whole forward, bit for bit, in every family with a
head (a Mamba first layer; Falcon-H1's packed mixer projection) and with FP8 projections (the
norm then writes FP8 rows); a model whose first layer is attention has none."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve import LLM
from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata


def _ids(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _row(tokens, ctx, slot, init, pages):
    return Row.standalone(tokens, ctx, slot, init, pages)


BATCHES = {
    "one prompt": Batch([_row(_ids(13, 0), 0, 0, False, [0, 1, 2, 3])], []),
    # a continued prompt, a fresh one and a decode row (the head covers every token of the step)
    "mixed": Batch([_row(_ids(9, 1), 6, 0, True, [0, 1, 2, 3]),
                    _row(_ids(5, 2), 0, 1, False, [4, 5])],
                   [_row([17], 11, 2, True, [6, 7, 8])]),
}


@pytest.mark.parametrize("name", list(BATCHES))
def test_forward_from_its_head_is_the_whole_forward(family_engine, random_pools, name):
    model, kv = family_engine.model, family_engine.kv_pool
    assert model.has_head
    cfg = model.cfg
    pools, start = random_pools
    meta = build_metadata(BATCHES[name], chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
                          page_size=kv.page_size, scratch_page=kv.scratch_page, device="cpu")
    with torch.inference_mode():
        whole = model(meta, *pools)
        after_whole = [t.clone() for t in pools]
        for t, s in zip(pools, start):
            t.copy_(s)
        head = model.forward_head(meta.input_ids)
        assert head.projected.shape[0] == meta.num_tokens
        from_head = model(meta, *pools, head=head)
    assert torch.equal(from_head, whole)
    for t, w in zip(pools, after_whole):
        assert torch.equal(t, w)


def test_attention_first_layer_has_no_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "ckpt", layers=["full_attention", "linear_attention"])
    model = LLM(path, device="cpu", max_model_len=32, max_num_seqs=2).engine.model
    assert not model.has_head
