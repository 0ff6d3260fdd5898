"""Triton write_kv + paged_attention vs. the torch references, on mixed batches built by
build_metadata: ragged prefill rows (some continuing a cached prefix written by an earlier
forward), decode rows, pages allocated in scrambled order, a pool full of stale garbage.

Without CUDA the kernels run under Triton's CPU interpreter (float32 / float16, small shapes);
float32 inputs use IEEE dots, so the tolerance is float32's. With CUDA the same cases run on the
GPU, plus a Nemotron-like shape in bf16 (40 query heads, 8 KV heads, head_dim 128, page 16).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

import mambaserve.ops.paged_attention as public_pa
import mambaserve.ops.triton.paged_attention as tpa
from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops.paged_attention import DenseRows, paged_attention_ref
from mambaserve.ops.paged_attention import write_kv as write_kv_any
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.paged_attention import (
    _paged_attention_kernel,
    choose_num_splits,
    paged_attention_triton,
    tiled_num_splits,
    write_kv_triton,
)

require_interpreter(_paged_attention_kernel)


def write_kv_ref(kv_cache, k, v, slot_mapping):
    """The torch reference (write_kv dispatches to Triton on CUDA)."""
    if not kv_cache.is_cuda:
        return write_kv_any(kv_cache, k, v, slot_mapping)
    _, n, ps, Hkv, Dh = kv_cache.shape
    flat = kv_cache.view(2, n * ps, Hkv, Dh)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _meta(prefills, decodes, page_size, scratch):
    return build_metadata(Batch(prefills=prefills, decodes=decodes), chunk_size=8,
                          conv_kernel=4, page_size=page_size, scratch_page=scratch, device=DEV)


def _row(n, ctx, slot, pages):
    return Row.standalone(token_ids=[1] * n, context_len=ctx, state_slot=slot, has_initial_state=ctx > 0,
                   pages=pages)


def _run(prefills, decodes, page_size, H, Hkv, Dh, dtype, seed=0, max_kv_len=None,
         split_at_prefill=False, tiled=False, dense=False, **knobs):
    """prefills / decodes: (context_len, new tokens). Writes every cached prefix with one
    forward, then runs the mixed batch; checks the pool and the attention output. `max_kv_len`
    overrides the bound given to the kernel (the reference always gets the metadata's).
    `split_at_prefill`: as the public op on CUDA, the tiled kernel writes the prefill rows and the
    per-token kernel the decode rows of one output tensor. `dense`: the public op's kernel path
    with the step's K/V and row spans (fresh long rows through SDPA). `knobs`: the `tuning` entry of the
    kernel that runs ("paged_attention_tiled" when `tiled`, else "paged_attention"; with
    `split_at_prefill` they go to the per-token kernel and the tiled one takes 32-row tiles)."""
    g = torch.Generator().manual_seed(seed)
    reqs = list(prefills) + list(decodes)
    lens = [c + n for c, n in reqs]
    need = [-(-L // page_size) for L in lens]
    num_pages = sum(need) + 3  # a few pages nobody owns
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(perm[at: at + n])
        at += n
    scratch = num_pages

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)

    k_all = [rnd(L, Hkv, Dh) for L in lens]
    v_all = [rnd(L, Hkv, Dh) for L in lens]
    garbage = rnd(2, num_pages + 1, page_size, Hkv, Dh, scale=30.0)
    kv_ref, kv_tri = garbage.clone(), garbage.clone()

    pre = [(i, c) for i, (c, _) in enumerate(reqs) if c > 0]
    if pre:
        m0 = _meta([_row(c, 0, i, pages[i]) for i, c in pre], [], page_size, scratch)
        k0 = torch.cat([k_all[i][:c] for i, c in pre])
        v0 = torch.cat([v_all[i][:c] for i, c in pre])
        write_kv_ref(kv_ref, k0, v0, m0.slot_mapping)
        write_kv_triton(kv_tri, k0, v0, m0.slot_mapping)
        assert torch.equal(kv_tri, kv_ref)

    P = len(prefills)
    meta = _meta([_row(n, c, i, pages[i]) for i, (c, n) in enumerate(prefills)],
                 [_row(n, c, P + j, pages[P + j]) for j, (c, n) in enumerate(decodes)],
                 page_size, scratch)
    k_new = torch.cat([k_all[i][c:c + n] for i, (c, n) in enumerate(reqs)])
    v_new = torch.cat([v_all[i][c:c + n] for i, (c, n) in enumerate(reqs)])
    write_kv_ref(kv_ref, k_new, v_new, meta.slot_mapping)
    write_kv_triton(kv_tri, k_new, v_new, meta.slot_mapping)
    assert torch.equal(kv_tri, kv_ref), "write_kv differs from the reference"

    q = rnd(meta.num_tokens, H, Dh)
    scale = Dh ** -0.5
    ref = paged_attention_ref(q, kv_ref, meta.page_table, meta.token_row, meta.positions,
                              meta.max_kv_len, scale)
    bound = meta.max_kv_len if max_kv_len is None else max_kv_len
    if split_at_prefill:
        Tp = meta.num_prefill_tokens
        out = torch.full_like(q, float("nan"))  # every row must be written
        with tuning.override("paged_attention_tiled", block_m=32):
            got = paged_attention_triton(q[:Tp], kv_tri, meta.page_table, meta.token_row[:Tp],
                                         meta.positions[:Tp], bound, scale, tiled=True,
                                         out=out[:Tp])
        assert got.data_ptr() == out.data_ptr()
        with tuning.override("paged_attention", **knobs):
            paged_attention_triton(q[Tp:], kv_tri, meta.page_table, meta.token_row[Tp:],
                                   meta.positions[Tp:], bound, scale, out=out[Tp:])
    elif dense:
        out = torch.full_like(q, float("nan"))  # every row must be written
        got = public_pa.paged_attention(
            q, kv_tri, meta.page_table, meta.token_row, meta.positions, bound, scale,
            meta.num_prefill_tokens, out, dense=DenseRows(k_new, v_new, meta.prefill.row_spans))
        assert got.data_ptr() == out.data_ptr()
    else:
        with tuning.override("paged_attention_tiled" if tiled else "paged_attention", **knobs):
            out = paged_attention_triton(q, kv_tri, meta.page_table, meta.token_row,
                                         meta.positions, bound, scale, tiled=tiled)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    return out, ref


# (context_len, new tokens): fresh and continued prefill rows (prefixes ending mid-page and on a
# page boundary), a one-token prefill row; decode rows at page starts, mid-page and position 0
PREFILLS = [(0, 7), (5, 9), (16, 3), (3, 1)]
DECODES = [(9, 1), (0, 1), (16, 1), (4, 1)]

CASES = [  # (page_size, H, Hkv, Dh)
    (4, 4, 4, 16), (4, 4, 2, 64), (4, 8, 2, 80),
    (16, 2, 2, 64), (16, 4, 2, 16), (16, 8, 2, 80),
]


VARIANTS = {"token": {}, "tiled": {"tiled": True, "block_m": 16}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size,H,Hkv,Dh", CASES)
def test_paged_attention_fp32(page_size, H, Hkv, Dh, variant):
    out, ref = _run(PREFILLS, DECODES, page_size, H, Hkv, Dh, torch.float32, seed=Dh + H,
                    **VARIANTS[variant])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_size,H,Hkv,Dh", [(4, 8, 2, 64), (16, 4, 1, 16)])
def test_paged_attention_fp16(page_size, H, Hkv, Dh, variant):
    out, ref = _run(PREFILLS, DECODES, page_size, H, Hkv, Dh, torch.float16, seed=7,
                    **VARIANTS[variant])
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_paged_attention_only_decodes_block_spans_pages():
    """Decode-only batch; a 32-key block covering 8 pages of 4 per step."""
    out, ref = _run([], [(37, 1), (2, 1), (64, 1)], 4, 4, 2, 16, torch.float32, seed=3,
                    block_n=32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rep,block_m", [(1, 16), (3, 16), (2, 64)])
def test_paged_attention_tiled_tiles(rep, block_m):
    """Tiled kernel: tiles spanning row boundaries and several decode rows, a head group that
    does not divide the tile (3 heads in 16 query rows -> 5 tokens per tile), an empty-tail tile,
    a zero-token prefill row between two rows."""
    prefills = [(0, 23), (4, 0), (7, 10), (30, 2)]
    decodes = [(c, 1) for c in (0, 3, 12, 5, 40)]
    out, ref = _run(prefills, decodes, 4, 2 * rep, 2, 16, torch.float32, seed=rep,
                    tiled=True, block_m=block_m)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("rep,block_m", [(1, 16), (3, 16), (2, 64)])
def test_paged_attention_tiled_split_keys(rep, block_m, num_splits):
    """The tiled kernel's key partitions (forced), merged by the combine kernel: tiles spanning
    rows, continued rows behind long cached prefixes (a follow-up turn's suffix), rows shorter
    than a partition (empty partitions), decode rows."""
    prefills = [(0, 23), (61, 3), (7, 10), (30, 2)]
    decodes = [(c, 1) for c in (0, 3, 12, 5, 40)]
    out, ref = _run(prefills, decodes, 4, 2 * rep, 2, 16, torch.float32, seed=rep + num_splits,
                    tiled=True, block_m=block_m, num_splits=num_splits, min_split_keys=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_paged_attention_tiled_splits_by_itself_behind_a_long_prefix(monkeypatch):
    """num_splits None: a few programs over a long cached context take key partitions
    (tiled_num_splits) and the result is the reference's; many programs keep one pass."""
    spy = _Spy(tpa._paged_attention_combine_kernel)
    monkeypatch.setattr(tpa, "_paged_attention_combine_kernel", spy)
    out, ref = _run([(200, 8)], [], 4, 8, 2, 16, torch.float32, seed=11, tiled=True,
                    block_m=32, min_split_keys=32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert spy.grids == [(8, 8)]  # the 8 tokens x 8 query heads merged
    assert tiled_num_splits(2, 208, 132, 32) == 7  # cdiv(208, 32) partitions at most
    assert tiled_num_splits(2, 131072, 132, 256) == 66  # one wave: 132 // 2
    assert tiled_num_splits(48, 2176, 132, 256) == 2  # a 128-token suffix behind 2,048 keys
    assert tiled_num_splits(40, 131072, 132, 256) == 3  # never past one wave (3 x 40 <= 132)
    assert tiled_num_splits(66, 131072, 132, 256) == 2  # half the SMs: still split
    assert tiled_num_splits(67, 131072, 132, 256) == 1  # programs enough: one pass
    assert tiled_num_splits(2, 100, 132, 256) == 1  # a short context: one partition


def test_empty_partitions_leave_no_trace_in_nan_scratch(monkeypatch):
    """Scratch starts as NaN (uninitialized memory may hold anything): the tiled kernel skips the
    accumulators of query rows with no key in a partition, and the combine must not read them."""
    real = tpa.split_scratch
    monkeypatch.setattr(tpa, "split_scratch", lambda *a: tuple(t.fill_(float("nan"))
                                                                for t in real(*a)))
    out, ref = _run([(0, 9), (40, 2)], [(3, 1)], 4, 8, 2, 16, torch.float32, seed=4,
                    split_at_prefill=False, tiled=True, block_m=16, num_splits=6,
                    min_split_keys=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out, ref = _run([], [(0, 1), (50, 1)], 4, 8, 2, 16, torch.float32, seed=5, num_splits=5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_paged_attention_tiled_split_ignores_nan_past_length(num_splits):
    """As the per-token split's NaN test, through the tiled kernel's partitions: the pool is NaN
    except each row's written keys."""
    page_size, H, Hkv, Dh = 4, 4, 2, 16
    g = torch.Generator().manual_seed(num_splits)
    meta, kv = _nan_but_rows([(37, 3), (0, 5), (12, 2)], [], page_size, Hkv, Dh, g)
    q = torch.randn(meta.num_tokens, H, Dh, generator=g).to(DEV)
    with tuning.override("paged_attention_tiled", num_splits=num_splits, min_split_keys=8,
                         block_m=16):
        out = paged_attention_triton(q, kv, meta.page_table, meta.token_row, meta.positions,
                                     meta.max_kv_len, 0.25, tiled=True)
    assert torch.isfinite(out).all()
    ref = paged_attention_ref(q, kv.nan_to_num(0.0), meta.page_table, meta.token_row,
                              meta.positions, meta.max_kv_len, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_public_op_runs_fresh_long_rows_dense(monkeypatch):
    """The public op's kernel path with the step's K/V: fresh rows of >= DENSE_MIN_TOKENS
    tokens (here 8) through SDPA, two equal-length ones as one [2, L] block; a fresh short row,
    rows continuing a cached prefix and the decode rows through the paged kernels; one output,
    every row written, against the reference."""
    monkeypatch.setattr(public_pa, "kernel_path", lambda op, device, **kw: "triton")
    monkeypatch.setattr(public_pa, "DENSE_MIN_TOKENS", 8)
    calls = []
    dense_attention = public_pa.dense_causal_attention
    monkeypatch.setattr(public_pa, "dense_causal_attention",
                        lambda q, *a: calls.append((q.shape[0], a[2])) or dense_attention(q, *a))
    prefills = [(0, 9), (0, 9), (5, 9), (0, 3), (0, 12), (16, 3)]
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    tol = 1e-2 if DEV == "cpu" else 2e-2
    out, ref = _run(prefills, DECODES, 4, 8, 2, 64, dtype, seed=11, dense=True)
    assert calls == [(18, 9), (12, 12)]  # (tokens, row length) of each dense block
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    calls.clear()
    monkeypatch.setenv(public_pa.DENSE_PREFILL_ENV, "0")  # switched off: every row paged
    out, ref = _run(prefills, DECODES, 4, 8, 2, 64, dtype, seed=11, dense=True)
    assert calls == []
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(DEV != "cuda", reason="flash attention and the 9B shape: GPU only")
def test_public_op_dense_rows_at_the_9b_shape_on_gpu():
    """The default threshold at Nemotron-Nano-9B-v2's attention shape in bf16: two fresh
    300-token rows as one flash block, a continued row, a short fresh row, decode rows."""
    prefills = [(0, 300), (0, 300), (40, 77), (0, 20)]
    out, ref = _run(prefills, [(500, 1), (3, 1)], 16, 40, 8, 128, torch.bfloat16, seed=5,
                    dense=True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tiled", [False, True])
def test_paged_attention_ignores_nonfinite_stale_slots(tiled):
    """NaN/inf in slots past a token's position (stale pages, tail of its last page) never leak."""
    page_size, H, Hkv, Dh = 4, 2, 1, 16
    meta = _meta([_row(3, 2, 0, [2, 0])], [_row(1, 5, 1, [1, 3])], page_size, 4)
    kv = torch.randn(2, 5, page_size, Hkv, Dh).to(DEV)
    kv[:, 0, 1:] = float("nan")  # row 0 reaches position 4 = page 0 offset 0 only
    kv[:, 3, 2:] = float("inf")  # row 1 reaches position 5 = page 3 offset 1
    kv[:, 4] = float("nan")  # scratch
    q = torch.randn(meta.num_tokens, H, Dh).to(DEV)
    out = paged_attention_triton(q, kv, meta.page_table, meta.token_row, meta.positions,
                                 meta.max_kv_len, 0.25, tiled=tiled)
    assert torch.isfinite(out).all()
    clean = kv.nan_to_num(0.0, 0.0, 0.0)
    ref = paged_attention_ref(q, clean, meta.page_table, meta.token_row, meta.positions,
                              meta.max_kv_len, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# split-KV (flash decoding) in the per-token kernel. BLOCK_N is 16 at page 4 and 16, so a token
# with n = position + 1 keys gets partitions of round_up(cdiv(n, num_splits), 16) keys: n = 1 and
# n <= 16 leave every partition but the first empty, n = 38 with 5 splits fills 3 (the last one
# partial: 6 keys) and leaves 2 empty, n = 100 with 5 splits fills 4 (32, 32, 32, 4) and leaves
# the fifth empty. A short prefill row sends tokens at positions 0..6 through the same kernel.
def _nan_but_rows(prefills, decodes, page_size, Hkv, Dh, g):
    """Metadata of the rows ((cached, new) each; pages drawn at random) and a KV pool that is NaN
    everywhere but the rows' keys (unwritten page tails, pages nobody owns, the scratch page)."""
    rows = list(prefills) + list(decodes)
    need = [-(-(c + n) // page_size) for c, n in rows]
    num_pages = sum(need) + 2
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages, at = [], 0
    for n in need:
        pages.append(perm[at: at + n])
        at += n
    made = [_row(n, c, i, pages[i]) for i, (c, n) in enumerate(rows)]
    meta = _meta(made[: len(prefills)], made[len(prefills):], page_size, num_pages)
    kv = torch.full((2, num_pages + 1, page_size, Hkv, Dh), float("nan"))
    for (c, n), pg in zip(rows, pages):
        for j in range(c + n):
            kv[:, pg[j // page_size], j % page_size] = torch.randn(2, Hkv, Dh, generator=g)
    return meta, kv.to(DEV)


SPLIT_PREFILLS = [(0, 7)]
SPLIT_DECODES = [(0, 1), (5, 1), (15, 1), (16, 1), (37, 1), (47, 1), (64, 1), (99, 1)]
SPLIT_CASES = [(4, 10, 2, 16), (16, 10, 2, 32), (4, 2, 2, 32)]  # (page, H, Hkv, Dh): rep 5, 5, 1


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5])
@pytest.mark.parametrize("page_size,H,Hkv,Dh", SPLIT_CASES)
def test_paged_attention_split_kv_fp32(page_size, H, Hkv, Dh, num_splits):
    out, ref = _run(SPLIT_PREFILLS, SPLIT_DECODES, page_size, H, Hkv, Dh, torch.float32,
                    seed=num_splits + Dh, num_splits=num_splits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("page_size,H,Hkv,Dh", SPLIT_CASES[:2])
def test_paged_attention_split_kv_fp16(page_size, H, Hkv, Dh, num_splits):
    out, ref = _run(SPLIT_PREFILLS, SPLIT_DECODES, page_size, H, Hkv, Dh, torch.float16,
                    seed=num_splits, num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_paged_attention_split_kv_ignores_nan_past_length(num_splits):
    """The whole pool is NaN except each row's keys 0..len-1 (unwritten page tails, pages nobody
    owns, the scratch page): split partitions, empty ones included, must not leak any of it."""
    page_size, H, Hkv, Dh = 4, 10, 2, 16
    g = torch.Generator().manual_seed(num_splits)
    meta, kv = _nan_but_rows([], [(c, 1) for c in (37, 0, 12, 70)], page_size, Hkv, Dh, g)
    q = torch.randn(meta.num_tokens, H, Dh, generator=g).to(DEV)
    with tuning.override("paged_attention", num_splits=num_splits):
        out = paged_attention_triton(q, kv, meta.page_table, meta.token_row, meta.positions,
                                     meta.max_kv_len, 0.25)
    assert torch.isfinite(out).all()
    ref = paged_attention_ref(q, kv.nan_to_num(0.0), meta.page_table, meta.token_row,
                              meta.positions, meta.max_kv_len, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_choose_num_splits():
    # the tuned min_split_keys (64)
    keys = tuning.config("paged_attention", "cpu")["min_split_keys"]
    assert keys == 64
    assert choose_num_splits(1, 8, 2048, 264, keys) == 32  # 9B decode batch 1: 2048 / 64
    assert choose_num_splits(1, 8, 131072, 264, keys) == 33  # cdiv(264, 8) programs' worth
    assert choose_num_splits(4, 8, 8192, 264, keys) == 9
    assert choose_num_splits(33, 8, 8192, 264, keys) == 1  # 264 programs: already full
    assert choose_num_splits(1, 8, 60, 264, keys) == 1  # short context: one partition
    assert choose_num_splits(1, 8, 0, 264, keys) == 1
    assert choose_num_splits(1, 2, 512, 264, min_split_keys=32) == 16


class _Spy:
    """Wraps a jitted kernel to record the grids it is launched with."""

    def __init__(self, fn):
        self.fn, self.grids = fn, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.fn[grid]


@pytest.mark.parametrize("max_kv_len,min_split_keys,splits", [
    (512, 32, 16),  # 16 partitions; tokens of up to 100 keys fill up to 4 of 32 keys
    (4096, 256, 16),  # CUDA-graph-like loose bound: only partition 0 holds keys
    (40, 16, 3),  # bound below the real lengths: the partitions still cover every key
])
def test_paged_attention_split_kv_heuristic(monkeypatch, max_kv_len, min_split_keys, splits):
    """num_splits=None with one decode token (T * H_kv = 2 programs): the launcher picks > 1
    split from host ints; the result matches the reference."""
    spy = _Spy(tpa._paged_attention_combine_kernel)
    monkeypatch.setattr(tpa, "_paged_attention_combine_kernel", spy)
    out, ref = _run([], [(99, 1)], 4, 10, 2, 16, torch.float32, seed=5, max_kv_len=max_kv_len,
                    min_split_keys=min_split_keys)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert spy.grids == [(1, 10)]
    assert choose_num_splits(1, 2, max_kv_len, 2 * tpa._sms(out.device),
                             min_split_keys) == splits


def test_empty_batch():
    kv = torch.zeros(2, 3, 4, 2, 16, device=DEV)
    q = torch.zeros(0, 4, 16, device=DEV)
    idx = torch.zeros(0, dtype=torch.int64, device=DEV)
    write_kv_triton(kv, q[:, :2], q[:, :2], idx)
    out = paged_attention_triton(q, kv, torch.zeros(1, 1, dtype=torch.int64, device=DEV), idx,
                                 idx, 0, 0.25)
    assert out.shape == (0, 4, 16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefills,decodes", [
    # sized for the reference, which materializes [T, max_kv_len, H, head_dim] fp32 K and V
    ([(0, 128), (300, 100), (17, 200)], [(c, 1) for c in (0, 15, 16, 999, 1500)]),
    ([], [(c, 1) for c in range(0, 8192, 97)]),
], ids=["mixed", "decode64"])
def test_paged_attention_nemotron_bf16_gpu(prefills, decodes):
    for tiled in (False, True):
        out, ref = _run(prefills, decodes, 16, 40, 8, 128, torch.bfloat16, seed=11, tiled=tiled)
        assert _rel(out, ref) < 1e-2, (tiled, _rel(out, ref))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_and_decode_rows_written_into_one_output(num_splits):
    """The public op's CUDA layout: tiled kernel into out[:Tp], per-token kernel (unsplit and
    split) into out[Tp:], no concatenation."""
    out, ref = _run(PREFILLS, DECODES, 4, 10, 2, 16, torch.float32, split_at_prefill=True,
                    num_splits=num_splits)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
