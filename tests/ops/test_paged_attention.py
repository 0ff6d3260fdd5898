"""write_kv + paged_attention vs per-row causal softmax attention in float64
(tests/ops/naive.py), with page tables / slot mappings built by the real build_metadata."""

from __future__ import annotations

import pytest
import torch
from naive import gen, meta_for, naive_causal_attention, randn, row, row_spans

from mambaserve.ops.paged_attention import (
    dense_causal_attention,
    flash_shaped,
    paged_attention,
    prefill_segments,
    write_kv,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
PAGE = 4
NUM_PAGES = 40
SCRATCH = NUM_PAGES  # last page of the pool

# (context_len, new tokens) of each request; prefill rows first, then decode rows
PREFILLS = [(0, 5), (6, 7), (8, 1), (3, 4), (0, 4)]
DECODES = [(9, 1), (3, 1), (4, 1), (0, 1), (7, 1)]


def pages_needed(n_tokens: int) -> int:
    return -(-n_tokens // PAGE)


def check_cache(kv, garbage, rows_pages, k_all, v_all, lengths):
    """Every written position holds its K/V; every other position of the pool (unowned pages,
    the scratch page, the unwritten tails of owned pages) still holds its old contents."""
    expect = garbage.clone()
    for pages, ks, vs, n in zip(rows_pages, k_all, v_all, lengths):
        for j in range(n):
            expect[0, pages[j // PAGE], j % PAGE] = ks[j]
            expect[1, pages[j // PAGE], j % PAGE] = vs[j]
    assert torch.equal(kv, expect), "write_kv wrote the wrong places"


@pytest.mark.parametrize("H,Hkv,Dh", [(4, 2, 8), (4, 1, 16), (2, 2, 4), (6, 3, 8)])
def test_mixed_batch_matches_naive(H, Hkv, Dh):
    g = gen("attn", H, Hkv, Dh)
    reqs = PREFILLS + DECODES
    steps = 3  # forward 1: the mixed batch; forwards 2, 3: every request decodes one token
    final_len = [c + n + steps - 1 for c, n in reqs]
    # scrambled, non-contiguous page allocation
    perm = torch.randperm(NUM_PAGES, generator=g).tolist()
    rows_pages, at = [], 0
    for L in final_len:
        rows_pages.append(perm[at: at + pages_needed(L)])
        at += pages_needed(L)
    assert at <= NUM_PAGES
    k_all = [randn(g, L, Hkv, Dh) for L in final_len]
    v_all = [randn(g, L, Hkv, Dh) for L in final_len]
    # the pool starts full of large finite garbage (stale pages of earlier requests)
    garbage = randn(g, 2, NUM_PAGES + 1, PAGE, Hkv, Dh, scale=50.0)
    kv = garbage.clone()

    # an earlier forward wrote the cached prefixes (rows with context_len > 0)
    pre = [(i, c) for i, (c, _) in enumerate(reqs) if c > 0]
    meta0 = meta_for([row(c, 0, i, False, rows_pages[i]) for i, c in pre], page_size=PAGE,
                     scratch_page=SCRATCH)
    write_kv(kv, torch.cat([k_all[i][:c] for i, c in pre]), torch.cat([v_all[i][:c] for i, c in pre]),
             meta0.slot_mapping)
    lengths = [c for c, _ in reqs]
    check_cache(kv, garbage, rows_pages, k_all, v_all, lengths)

    scale = Dh ** -0.5
    for step in range(steps):
        if step == 0:
            prefills = [row(n, c, i, c > 0, rows_pages[i]) for i, (c, n) in enumerate(PREFILLS)]
            decodes = [row(1, c, len(PREFILLS) + j, True, rows_pages[len(PREFILLS) + j])
                       for j, (c, _) in enumerate(DECODES)]
        else:
            prefills = []
            decodes = [row(1, lengths[i], i, True, rows_pages[i]) for i in range(len(reqs))]
        meta = meta_for(prefills, decodes, page_size=PAGE, scratch_page=SCRATCH)
        batch = prefills + decodes
        spans = row_spans(batch)
        k_new = torch.cat([k_all[r.state_slot][r.context_len: r.context_len + r.num_tokens]
                           for r in batch])
        v_new = torch.cat([v_all[r.state_slot][r.context_len: r.context_len + r.num_tokens]
                           for r in batch])
        q = randn(g, meta.num_tokens, H, Dh)
        write_kv(kv, k_new, v_new, meta.slot_mapping)
        for r in batch:
            lengths[r.state_slot] = r.context_len + r.num_tokens
        check_cache(kv, garbage, rows_pages, k_all, v_all, lengths)

        out = paged_attention(q, kv, meta.page_table, meta.token_row, meta.positions,
                              meta.max_kv_len, scale)
        assert out.shape == (meta.num_tokens, H, Dh) and out.dtype == torch.float32
        for r, (s, e) in zip(batch, spans):
            i, c = r.state_slot, r.context_len
            ref = naive_causal_attention(q[s:e], k_all[i][: c + r.num_tokens],
                                         v_all[i][: c + r.num_tokens],
                                         torch.arange(c, c + r.num_tokens), scale)
            torch.testing.assert_close(out[s:e], ref.float(), **TOL)


def test_max_kv_len_beyond_longest_row():
    """A max_kv_len larger than every row (up to the page table's capacity) changes nothing."""
    H, Hkv, Dh = 4, 2, 8
    g = gen("attn-maxlen")
    rows = [row(3, 2, 0, True, [5, 1]), row(1, 4, 1, True, [7, 2, 9])]
    meta = meta_for(rows[:1], rows[1:], page_size=PAGE, scratch_page=SCRATCH)
    kv = randn(g, 2, NUM_PAGES + 1, PAGE, Hkv, Dh)
    q = randn(g, meta.num_tokens, H, Dh)
    a = paged_attention(q, kv, meta.page_table, meta.token_row, meta.positions, meta.max_kv_len,
                        0.3)
    b = paged_attention(q, kv, meta.page_table, meta.token_row, meta.positions,
                        meta.page_table.shape[1] * PAGE, 0.3)
    torch.testing.assert_close(a, b, **TOL)
    # row 1's token at position 4 sees positions 0..4 of pages [7, 2]
    k = torch.cat([kv[0, 7], kv[0, 2, :1]])
    v = torch.cat([kv[1, 7], kv[1, 2, :1]])
    ref = naive_causal_attention(q[3:], k, v, torch.tensor([4]), 0.3)
    torch.testing.assert_close(a[3:], ref.float(), **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_and_decode_tokens_split_between_kernels_on_gpu(dtype):
    """With `num_prefill_tokens` the prefill tokens take the tiled kernel and the decode tokens
    the per-token kernel (mixed, prefill-only and decode-only batches): same as the reference."""
    from mambaserve.engine.batch import Batch
    from mambaserve.metadata import build_metadata
    from mambaserve.ops.paged_attention import paged_attention_ref

    H, Hkv, Dh, page = 40, 8, 128, 16
    g = torch.Generator().manual_seed(7)
    lens = [(0, 300), (40, 77), (0, 1)]  # (context, new) prefill rows
    dec = [(500, 1), (3, 1), (0, 1)]
    pages, at = [], 0
    for c, n in lens + dec:
        k = -(-(c + n) // page)
        pages.append(list(range(at, at + k)))
        at += k
    plan = Batch(prefills=[row(n, c, i, c > 0, pages[i]) for i, (c, n) in enumerate(lens)],
                     decodes=[row(1, c, len(lens) + j, True, pages[len(lens) + j])
                              for j, (c, _) in enumerate(dec)])
    meta = build_metadata(plan, chunk_size=8, conv_kernel=4, page_size=page, scratch_page=at,
                          device="cuda")
    kv = torch.randn(2, at + 1, page, Hkv, Dh, generator=g).to("cuda", dtype)
    q = torch.randn(meta.num_tokens, H, Dh, generator=g).to("cuda", dtype)
    args = (kv, meta.page_table, meta.token_row, meta.positions, meta.max_kv_len, Dh ** -0.5)
    ref = paged_attention_ref(q, *args)
    tol = {"rtol": 2e-5, "atol": 2e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    Tp = meta.num_prefill_tokens
    torch.testing.assert_close(paged_attention(q, *args, Tp), ref, **tol)
    torch.testing.assert_close(paged_attention(q[:Tp], kv, meta.page_table, meta.token_row[:Tp],
                                               meta.positions[:Tp], meta.max_kv_len, Dh ** -0.5,
                                               Tp), ref[:Tp], **tol)
    torch.testing.assert_close(paged_attention(q[Tp:], kv, meta.page_table, meta.token_row[Tp:],
                                               meta.positions[Tp:], meta.max_kv_len, Dh ** -0.5),
                               ref[Tp:], **tol)


def test_prefill_segments_runs_of_rows():
    """Fresh rows of >= min_tokens: dense blocks, consecutive equal lengths merged; every other
    row (a cached prefix, too short) in paged runs, consecutive ones merged; empty rows skipped."""
    spans = ((0, 300, 0), (300, 300, 0), (600, 100, 0), (700, 0, 0), (700, 50, 8),
             (750, 300, 0), (1050, 400, 0), (1450, 300, 16))
    assert prefill_segments(spans, 1750, 256) == [
        (0, 600, 300), (600, 750, 0), (750, 1050, 300), (1050, 1450, 400), (1450, 1750, 0)]
    assert prefill_segments(spans, 1750, 10_000) == [(0, 1750, 0)]
    assert prefill_segments((), 0, 1) == []


@pytest.mark.parametrize("spans,tokens", [(((0, 4, 0), (5, 3, 0)), 8), (((0, 4, 0),), 5)])
def test_prefill_segments_refuses_spans_that_do_not_tile_the_prefill(spans, tokens):
    with pytest.raises(ValueError, match="prefill row spans"):
        prefill_segments(spans, tokens, 1)


@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 3)])
def test_dense_causal_attention_matches_naive(H, Hkv):
    """Rows of L tokens attending to their own keys, into a strided output (a column slice of a
    wider buffer, as Falcon-H1's mixer output)."""
    g = gen("dense", H, Hkv)
    n, L, Dh = 3, 6, 8
    q, k, v = randn(g, n * L, H, Dh), randn(g, n * L, Hkv, Dh), randn(g, n * L, Hkv, Dh)
    wide = torch.full((n * L, H * Dh + 5), float("nan"))
    out = wide[:, 5:].view(n * L, H, Dh)
    got = dense_causal_attention(q, k, v, L, 0.3, out)
    assert got.data_ptr() == out.data_ptr() and not wide[:, 5:].isnan().any()
    for r in range(n):
        t = slice(r * L, (r + 1) * L)
        want = naive_causal_attention(q[t], k[t], v[t], torch.arange(L), 0.3)
        torch.testing.assert_close(out[t].double(), want, **TOL)


def test_only_flash_shaped_queries_run_dense():
    """16-bit, head_dim a multiple of 8 up to 256: what SDPA serves with flash attention."""
    for dtype, d, ok in [(torch.bfloat16, 128, True), (torch.float16, 64, True),
                         (torch.float32, 128, False), (torch.bfloat16, 80, True),
                         (torch.bfloat16, 100, False), (torch.bfloat16, 512, False)]:
        assert flash_shaped(torch.empty(3, 2, d, dtype=dtype)) is ok, (dtype, d)
