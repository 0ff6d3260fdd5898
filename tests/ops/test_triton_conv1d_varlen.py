"""Triton causal_conv1d_varlen vs. the reference on ragged build_metadata batches (CPU interpreter
without CUDA; GPU with it)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops.conv1d import causal_conv1d_varlen, causal_conv1d_varlen_ref
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.conv1d_varlen import _conv_varlen_kernel, causal_conv1d_varlen_triton

require_interpreter(_conv_varlen_kernel)


def _run(rows, Dm, K, dtype, bias=True, activation=True, nan_fresh=False, seed=0, tol=None,
         state_dtype=None, **knobs):
    """rows: (num_tokens, context_len, slot, has_initial_state); `knobs`: the launcher's `tuning`
    entry "conv1d_varlen"."""
    gen = torch.Generator().manual_seed(seed)
    plan = Batch(prefills=[Row.standalone([1] * n, ctx, slot, init, [0]) for n, ctx, slot, init in rows],
                     decodes=[])
    meta = build_metadata(plan, chunk_size=16, conv_kernel=K, page_size=1 << 20, scratch_page=0,
                          device=DEV)
    T = meta.num_prefill_tokens
    num_slots = max(r[2] for r in rows) + 2
    state = torch.randn(num_slots + 1, K - 1, Dm, generator=gen).to(DEV, state_dtype or dtype)
    x = torch.randn(T, Dm + 9, generator=gen).to(DEV, dtype)[:, 4: 4 + Dm]  # strided like xBC
    w = (torch.randn(Dm, K, generator=gen) * 0.5).to(DEV, dtype)
    b = (torch.randn(Dm, generator=gen) * 0.5).to(DEV, dtype) if bias else None
    args = (meta.prefill.state_slots.to(torch.int32), meta.prefill.has_initial_state,
            meta.prefill.conv_window_idx, meta.prefill.conv_state_idx, activation)
    st_ref, st = state.clone(), state.clone()
    if nan_fresh:  # stale NaN in the slots of rows without an initial state
        for n, ctx, slot, init in rows:
            if not init and slot >= 0:
                st_ref[slot] = 0.0
                st[slot] = float("nan")
    # a negative slot reads nothing in the kernel (zero initial state); the reference reads the
    # scratch slot instead, even with has_initial_state: give it zeros there
    st_ref[-1] = 0.0
    out_ref = causal_conv1d_varlen_ref(x, w, b, st_ref, *args)
    with tuning.override("conv1d_varlen", **knobs):
        out = causal_conv1d_varlen_triton(x, w, b, st, *args)
    tol = tol or (1e-5 if dtype == torch.float32 else 5e-3)
    assert out.dtype == x.dtype and not torch.isnan(out).any()
    if dtype == torch.bfloat16:
        # the reference rounds the conv sum, bias add and silu to bf16; the kernel stays in float32
        # until the final cast: single elements can differ by a bf16 ulp, compare by norm
        assert ((out.float() - out_ref.float()).norm() / out_ref.float().norm()).item() < tol
    else:
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(st[:-1], st_ref[:-1])  # new states are exact copies
    torch.testing.assert_close(st[-1], state[-1])  # scratch untouched


# rows shorter than K-1 (old saved inputs shift within the slot), fresh rows, a padding row
ROWS = [(9, 0, 0, False), (1, 5, 2, True), (2, 7, 1, True), (20, 3, 3, True), (4, 0, -1, False)]


@pytest.mark.parametrize("K", [4, 2])
def test_conv_varlen_fp32(K):
    _run(ROWS, 100, K, torch.float32, seed=K, block_t=8, block_d=64)


def test_conv_varlen_nobias_noact_nan_fresh_slot():
    _run(ROWS, 48, 4, torch.float32, bias=False, activation=False, nan_fresh=True, block_t=16,
         block_d=32)


def test_conv_varlen_fp16():
    _run(ROWS[:3], 64, 4, torch.float16, block_t=16, block_d=64)


# Many rows per token tile and rows across tiles: 1-token rows, rows shorter than K-1 (with and
# without initial state), zero-token rows, negative slots (also on short rows), long rows spanning
# several tiles.
MANY = [(1, 0, 0, True), (1, 3, 1, False), (2, 0, 2, True), (0, 4, 3, True), (3, 1, 4, True),
        (1, 0, -1, True), (13, 2, 5, False), (2, 9, 6, True), (0, 0, 7, False), (1, 1, 8, True),
        (40, 0, 9, True), (5, 5, -1, False), (2, 2, 10, False), (70, 3, 11, True),
        (1, 0, 12, True), (2, 0, -1, True)]


@pytest.mark.parametrize("block_t,block_d,num_warps,lookahead,unroll", [
    (1, 16, 1, 0, True), (2, 32, 1, 1, True), (4, 16, 2, 4, True), (8, 64, 4, 2, False),
    (32, 32, 2, 3, True), (128, 64, 4, 0, False)])
def test_conv_varlen_tiles_cross_rows(block_t, block_d, num_warps, lookahead, unroll):
    _run(MANY, 40, 4, torch.float32, seed=block_t, nan_fresh=True, block_t=block_t,
         block_d=block_d, num_warps=num_warps, lookahead=lookahead, unroll=unroll)


@pytest.mark.parametrize("lookahead", [0, 1, 2, 3, 4])
def test_conv_varlen_long_rows_lookahead(lookahead):
    # tiles inside long rows take the unrolled loop; the last tile is partial (T = 87)
    rows = [(37, 0, 0, False), (50, 3, 1, True)]
    _run(rows, 48, 4, torch.float32, seed=20 + lookahead, block_t=8, block_d=16,
         lookahead=lookahead)


@pytest.mark.parametrize("K", [2, 3, 5])
def test_conv_varlen_tiles_cross_rows_widths(K):
    _run(MANY, 24, K, torch.float32, seed=10 + K, bias=K != 3, activation=K != 5, nan_fresh=True,
         block_t=16, block_d=16, state_block_d=16, lookahead=2)


@pytest.mark.parametrize("K", [6, 7])
def test_conv_varlen_widths_outside_the_kernel(K):
    """Widths outside 2..5: the dispatch picks the reference even on CUDA, the launcher refuses
    them, and the public op (reference here) still matches the reference."""
    w = torch.zeros(8, K)
    assert kernel_path("causal_conv1d_varlen", "cuda", weight=w) == "reference"
    assert kernel_path("causal_conv1d_varlen", "cuda", weight=torch.zeros(8, 4)) == "triton"
    plan = Batch(prefills=[Row.standalone([1] * 5, 2, 0, True, [0])], decodes=[])
    meta = build_metadata(plan, chunk_size=16, conv_kernel=K, page_size=1 << 20, scratch_page=0,
                          device="cpu")
    gen = torch.Generator().manual_seed(K)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(8, K, generator=gen)
    pm = meta.prefill
    args = (pm.state_slots.to(torch.int32), pm.has_initial_state, pm.conv_window_idx,
            pm.conv_state_idx)
    st = torch.randn(2, K - 1, 8, generator=gen)
    st_ref = st.clone()
    out = causal_conv1d_varlen(x, w, None, st, *args)
    assert torch.equal(out, causal_conv1d_varlen_ref(x, w, None, st_ref, *args))
    assert torch.equal(st, st_ref)
    with pytest.raises(AssertionError, match="2..5"):
        causal_conv1d_varlen_triton(x.to(DEV), w.to(DEV), None, st.to(DEV),
                                    *(a.to(DEV) for a in args))


def test_conv_varlen_fp16_fp32_state():
    # saved inputs are rounded to x.dtype before the conv and before being written back (as the
    # reference's extended stream)
    _run(MANY, 32, 4, torch.float16, state_dtype=torch.float32, block_t=32, block_d=32)


def test_conv_varlen_default_blocks():
    rows = MANY + [(n, ctx, slot + 13 if slot >= 0 else slot, init) for n, ctx, slot, init in ROWS]
    _run(rows, 136, 4, torch.float32, seed=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_conv_varlen_nemotron9b_bf16_gpu():
    rows = [(2048, 0, 0, False), (2000, 100, 1, True), (2, 7, 2, True), (700, 5, 3, False)]
    _run(rows, 12288, 4, torch.bfloat16, tol=1e-2)
