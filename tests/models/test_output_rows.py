"""The forward's tail on the logits rows alone (models/output_rows.py): after the last layer that
mixes tokens, a step with fewer logits rows than token rows computes the rest on those rows only
(the last Mamba mixer's z projection, gated norm, out_proj and scan output, or the last
attention's o_proj, and the blocks after it). The logits are those of the forward that
computes every row, the state and KV pools the same bits, in every family and with FP8
projections; a prompt's middle chunk (no logits row) skips the tail; prompt logprobs (every row a
logits row) keep every row."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoint import make_tiny_checkpoint

from mambaserve import LLM
from mambaserve.config import LayerKind
from mambaserve.engine.batch import Batch, Row
from mambaserve.engine.request import Request
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.layers.mamba2_mixer import _out_chunks
from mambaserve.metadata import build_metadata
from mambaserve.model_layout import FFNKind
from mambaserve.models.output_rows import output_rows, tail_start

PS = 4  # the page size of the batches' page lists (conftest's family_engine too)


def _ids(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _row(tokens, ctx, slot, pages, *, more=0, prompt_logprobs=None):
    """A row of `tokens` after `ctx` tokens of context; `more` prompt tokens follow it (a chunk
    that does not end its prompt: no sampled token)."""
    ids = [7] * ctx + tokens + [9] * more
    req = Request("r", None, ids, SamplingParams(prompt_logprobs=prompt_logprobs), 0, len(ids) + 4)
    req.state_slot, req.pages = slot, list(pages)
    return Row(req, ctx, len(tokens), has_initial_state=ctx > 0)


BATCHES = {
    "one prompt": lambda: Batch([_row(_ids(13, 0), 0, 0, [0, 1, 2, 3])], []),
    "two prompts": lambda: Batch([_row(_ids(11, 1), 0, 0, [0, 1, 2]),
                                  _row(_ids(6, 2), 0, 1, [4, 5])], []),
    # a continued prompt, a fresh one and a decode row
    "mixed": lambda: Batch([_row(_ids(9, 3), 6, 0, [0, 1, 2, 3]),
                            _row(_ids(5, 4), 0, 1, [4, 5])],
                           [_row([17], 11, 2, [6, 7, 8])]),
    "middle chunk": lambda: Batch([_row(_ids(12, 5), 0, 0, [0, 1, 2, 3, 4], more=5)], []),
    "prompt logprobs": lambda: Batch([_row(_ids(10, 6), 0, 0, [0, 1, 2], prompt_logprobs=1)],
                                     []),
}


def _forward(model, meta, pools, start, tail):
    for t, s in zip(pools, start):
        t.copy_(s)
    model.tail_start = tail
    with torch.inference_mode():
        logits = model(meta, *pools)
    return logits, [t.clone() for t in pools]


@pytest.mark.parametrize("name", list(BATCHES))
def test_the_tail_on_the_logits_rows_is_the_whole_forward(family_engine, random_pools, name,
                                                          monkeypatch):
    model, kv = family_engine.model, family_engine.kv_pool
    tail = model.tail_start
    assert tail is not None
    cfg = model.cfg
    pools, start = random_pools
    batch = BATCHES[name]()
    meta = build_metadata(batch, chunk_size=cfg.chunk_size, conv_kernel=cfg.conv_kernel,
                          page_size=kv.page_size, scratch_page=kv.scratch_page, device="cpu")
    n_logits = sum(len(r.logits_positions) for r in batch.rows)
    assert meta.logits_idx.shape[0] == n_logits
    narrowed = output_rows(meta.logits_idx, meta.num_tokens) is not None
    assert narrowed == (name != "prompt logprobs")
    # the tail's blocks see the logits rows only (every row where none is narrowed)
    seen = []
    owner, name = _tail_norm(model, tail)
    monkeypatch.setattr(owner, name, _recording(getattr(owner, name), seen))
    full, full_pools = _forward(model, meta, pools, start, None)
    seen_full = list(seen)
    seen.clear()
    rows, rows_pools = _forward(model, meta, pools, start, tail)
    model.tail_start = tail
    assert rows.shape == full.shape == (n_logits, cfg.vocab_size)
    torch.testing.assert_close(rows, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(rows_pools, full_pools):
        assert torch.equal(a, b)
    assert seen_full == [meta.num_tokens]
    assert seen == ([n_logits] if n_logits else []) if narrowed else [meta.num_tokens]


@pytest.mark.parametrize("name", ["one prompt", "two prompts", "mixed", "middle chunk"])
def test_the_scan_chunks_of_the_output_rows(name):
    """The chunks the last mixer's scan computes its output for hold every logits row of a
    prefill (a decode row's entry is a prefill chunk, so the list stays as long as the rows)."""
    batch = BATCHES[name]()
    meta = build_metadata(batch, chunk_size=4, conv_kernel=4, page_size=PS, scratch_page=99,
                          device="cpu")
    pf, Tp = meta.prefill, meta.num_prefill_tokens
    chunks = _out_chunks(pf, meta.logits_idx, Tp)
    assert chunks.shape == meta.logits_idx.shape
    for t, c in zip(meta.logits_idx.tolist(), chunks.tolist()):
        assert 0 <= c < pf.num_chunks
        if t < Tp:
            assert t in pf.chunk_token_idx[c].tolist()
    every = torch.arange(meta.num_tokens)  # as many rows as chunks or more: every chunk
    assert _out_chunks(pf, every, Tp) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("last", ["attention", "mamba"])
@pytest.mark.parametrize("name", ["one prompt", "mixed", "middle chunk"])
def test_the_tail_on_the_logits_rows_on_cuda(tiny_ckpt, tmp_path, name, last):
    """bf16 on CUDA (the Triton kernels; the few-rows linear for the tail's rows, in_proj split
    over its weight's rows, the scan's output on listed chunks): within bf16 rounding of the
    every-row forward, whether the last token-mixing layer is attention or Mamba."""
    path = tiny_ckpt if last == "attention" else make_tiny_checkpoint(
        tmp_path / "ckpt", seed=2, layers=["linear_attention", "full_attention", "mlp",
                                           "linear_attention", "mlp"])
    engine = LLM(path, device="cuda", dtype="bfloat16", max_model_len=64, max_num_seqs=4,
                 page_size=PS, enforce_eager=True).engine
    model, sp, kv = engine.model, engine.state_pool, engine.kv_pool
    cfg, tail = model.cfg, model.tail_start
    pools = (sp.conv_state, sp.ssm_state, kv.kv_cache)
    g = torch.Generator(device="cuda").manual_seed(5)
    for t in pools:
        t.copy_(0.5 * torch.randn(t.shape, generator=g, device="cuda"))
    start = [t.clone() for t in pools]
    meta = build_metadata(BATCHES[name](), chunk_size=cfg.chunk_size,
                          conv_kernel=cfg.conv_kernel, page_size=PS,
                          scratch_page=kv.scratch_page, device="cuda")
    full, full_pools = _forward(model, meta, pools, start, None)
    rows, rows_pools = _forward(model, meta, pools, start, tail)
    model.tail_start = tail
    assert rows.shape == full.shape
    scale = full.abs().max().item() if full.numel() else 1.0
    torch.testing.assert_close(rows, full, rtol=2e-2, atol=2e-2 * scale)
    for a, b in zip(rows_pools, full_pools):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def _tail_norm(model, tail):
    """(module, method name) of the norm in front of the tail's last sub-block: it runs on the
    rows the tail computes (none at all where no logits row is read)."""
    if isinstance(tail, tuple):  # the hybrid decoder
        layer = model.layers[-1]
        if layer.spec.ffn is not FFNKind.NONE:
            return layer.pre_ff_layernorm, "forward"
        return layer.mamba, "_gated_norm"  # a Mamba mixer's output part
    return model.layers[-1].norm, "forward"


def _recording(fn, seen):
    def forward(x, *a, **kw):
        seen.append(x.shape[0])
        return fn(x, *a, **kw)
    return forward


@pytest.mark.parametrize("pattern, start", [
    ("M-M*-M-", 5),  # the last Mamba's output part, then the MLP
    ("M*-", 1),  # attention's o_proj on the logits rows, then the MLP
    ("M-M", 2), ("ME", 0), ("MEME", 2), ("M*", 1), ("---", None),
])
def test_tail_start_of_nemotron_h_patterns(pattern, start):
    """NemotronH: every token-mixing block's output part takes the rows (the model's rule)."""
    kinds = {"M": LayerKind.MAMBA, "*": LayerKind.ATTENTION, "-": LayerKind.MLP,
             "E": LayerKind.MOE}
    stateful = [kinds[c] in (LayerKind.MAMBA, LayerKind.ATTENTION) for c in pattern]
    assert tail_start(stateful, stateful) == start


def test_tail_start_after_a_block_that_takes_no_rows():
    """A last token-mixing block whose output part takes no rows (Falcon-H1's two mixers in one
    projection): the tail starts at the block after it, or nowhere."""
    assert tail_start([True, False, True, False], [True, False, False, False]) == 3
    assert tail_start([True, False, True], [True, False, False]) is None
    assert tail_start([False, False], [False, False]) is None
