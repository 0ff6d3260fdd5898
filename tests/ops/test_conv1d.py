"""causal_conv1d_varlen / causal_conv1d_update vs a per-row, per-token depthwise conv
(tests/ops/naive.py), with the gather indices built by the real build_metadata."""

from __future__ import annotations

import pytest
import torch
from naive import gen, meta_for, naive_conv_row, randn, row, row_spans

from mambaserve.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen

TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_SLOTS = 10  # + 1 scratch
DIM = 12


def strided(g, T, Dm):
    """x as a column slice of a wider tensor, like xBC = zxbcdt.split(...)[1] in the mixer."""
    base = randn(g, T, Dm + 7)
    x = base[:, 3:3 + Dm]
    assert not x.is_contiguous()
    return x


def check_untouched(conv_state, state0, used):
    for s in range(NUM_SLOTS + 1):
        if s not in used:
            assert torch.equal(conv_state[s], state0[s]), f"slot {s} was modified"


@pytest.mark.parametrize("activation", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_conv_varlen_matches_naive(K, use_bias, activation):
    g = gen("conv-varlen", K, use_bias, activation)
    slots = torch.randperm(NUM_SLOTS, generator=g).tolist()
    specs = [(1, 0, True), (2, 4, True), (1, 0, False), (7, 0, False), (3, 9, True), (13, 2, True),
             (2, 0, False)]  # (n, context_len, has_initial_state): rows shorter than K-1 included
    rows = [row(n, ctx, slots[i], init) for i, (n, ctx, init) in enumerate(specs)]
    meta = meta_for(rows, conv_kernel=K)
    T = meta.num_prefill_tokens
    x = strided(g, T, DIM)
    weight, bias = randn(g, DIM, K), (randn(g, DIM) if use_bias else None)
    state0 = randn(g, NUM_SLOTS + 1, K - 1, DIM)
    conv_state = state0.clone()

    out = causal_conv1d_varlen(x, weight, bias, conv_state, meta.prefill.state_slots,
                               meta.prefill.has_initial_state, meta.prefill.conv_window_idx, meta.prefill.conv_state_idx,
                               activation=activation)
    assert out.shape == (T, DIM) and out.dtype == torch.float32
    for r, (s, e) in zip(rows, row_spans(rows)):
        w0 = state0[r.state_slot] if r.has_initial_state else torch.zeros(K - 1, DIM)
        ref, new_window = naive_conv_row(x[s:e], weight, bias, w0, activation)
        torch.testing.assert_close(out[s:e], ref.float(), **TOL)
        # the saved window is raw inputs: an exact copy, no arithmetic
        assert torch.equal(conv_state[r.state_slot], new_window.float()), (
            f"row {r}: wrong conv state")
    check_untouched(conv_state, state0, {r.state_slot for r in rows})


def test_conv_varlen_negative_slot_touches_no_real_slot():
    K = 4
    g = gen("conv-neg")
    rows = [row(5, 0, 2, True), row(2, 0, -1, True), row(4, 0, 7, False), row(1, 3, -1, False)]
    meta = meta_for(rows, conv_kernel=K)
    x = strided(g, meta.num_prefill_tokens, DIM)
    weight, bias = randn(g, DIM, K), randn(g, DIM)
    state0 = randn(g, NUM_SLOTS + 1, K - 1, DIM)
    conv_state = state0.clone()
    out = causal_conv1d_varlen(x, weight, bias, conv_state, meta.prefill.state_slots,
                               meta.prefill.has_initial_state, meta.prefill.conv_window_idx, meta.prefill.conv_state_idx)
    spans = row_spans(rows)
    for i in (0, 2):
        r, (s, e) = rows[i], spans[i]
        w0 = state0[r.state_slot] if r.has_initial_state else torch.zeros(K - 1, DIM)
        ref, new_window = naive_conv_row(x[s:e], weight, bias, w0)
        torch.testing.assert_close(out[s:e], ref.float(), **TOL)
        assert torch.equal(conv_state[r.state_slot], new_window.float())
    check_untouched(conv_state, state0, {2, 7, NUM_SLOTS})  # scratch may change


@pytest.mark.parametrize("K", [2, 3, 4])
def test_conv_update_matches_naive(K):
    g = gen("conv-update", K)
    slots = torch.randperm(NUM_SLOTS, generator=g)[:5].tolist()
    decodes = [row(1, 3 + i, s, True) for i, s in enumerate(slots)]
    decodes.insert(2, row(1, 0, -1, True))  # a padding row among them
    meta = meta_for([], decodes, conv_kernel=K)
    B = meta.num_decodes
    x = strided(g, B, DIM)
    weight, bias = randn(g, DIM, K), randn(g, DIM)
    state0 = randn(g, NUM_SLOTS + 1, K - 1, DIM)
    conv_state = state0.clone()
    out = causal_conv1d_update(x, weight, bias, conv_state, meta.decode_state_slots)
    assert out.shape == (B, DIM)
    for i, r in enumerate(decodes):
        if r.state_slot < 0:
            continue
        ref, new_window = naive_conv_row(x[i:i + 1], weight, bias, state0[r.state_slot])
        torch.testing.assert_close(out[i:i + 1], ref.float(), **TOL)
        assert torch.equal(conv_state[r.state_slot], new_window.float())
    check_untouched(conv_state, state0, set(slots) | {NUM_SLOTS})


@pytest.mark.parametrize("K", [2, 4])
def test_conv_mixed_batch_then_decode_equals_full_stream(K):
    """One mixed forward (prefill rows via varlen, decode rows via update on the same pool, as the
    mixer does), then two decode-only forwards: every output equals the conv over each request's
    whole input stream."""
    g = gen("conv-stream", K)
    weight, bias = randn(g, DIM, K), randn(g, DIM)
    conv_state = randn(g, NUM_SLOTS + 1, K - 1, DIM)
    # request -> (slot, history window before this forward or None = fresh, all inputs so far)
    reqs = {0: (4, None), 1: (1, None), 2: (8, randn(g, K - 1, DIM)), 3: (6, randn(g, K - 1, DIM))}
    for rid in (2, 3):  # decoding requests: their window is already in the pool
        conv_state[reqs[rid][0]] = reqs[rid][1]
    history = {rid: (torch.zeros(K - 1, DIM) if w is None else w) for rid, (_, w) in reqs.items()}
    outs = {rid: [] for rid in reqs}

    prefills = [row(6, 0, reqs[0][0], False), row(1, 0, reqs[1][0], False)]
    decodes = [row(1, 5, reqs[2][0], True), row(1, 9, reqs[3][0], True)]
    order = [0, 1, 2, 3]  # batch order of the requests (prefill rows first)
    for _ in range(3):
        meta = meta_for(prefills, decodes, conv_kernel=K)
        T, Tp = meta.num_tokens, meta.num_prefill_tokens
        x = strided(g, T, DIM)
        out = torch.empty(T, DIM)
        if meta.num_prefills:
            out[:Tp] = causal_conv1d_varlen(
                x[:Tp], weight, bias, conv_state, meta.prefill.state_slots,
                meta.prefill.has_initial_state, meta.prefill.conv_window_idx, meta.prefill.conv_state_idx)
        out[Tp:] = causal_conv1d_update(x[Tp:], weight, bias, conv_state, meta.decode_state_slots)
        for rid, (s, e) in zip(order, row_spans(prefills + decodes)):
            history[rid] = torch.cat([history[rid], x[s:e]])
            outs[rid].append(out[s:e])
        # next forwards: everyone decodes one token
        prefills, decodes = [], [row(1, 0, reqs[rid][0], True) for rid in order]

    for rid in reqs:
        stream = history[rid]
        ref, window = naive_conv_row(stream[K - 1:], weight, bias, stream[: K - 1])
        torch.testing.assert_close(torch.cat(outs[rid]), ref.float(), **TOL)
        assert torch.equal(conv_state[reqs[rid][0]], window.float())


def test_conv_fresh_row_ignores_garbage_in_its_slot():
    """StatePool: "a free slot's contents: garbage; a new request starts with has_initial_state =
    False". A fresh row must not depend on what its slot holds, even non-finite leftovers."""
    K = 4
    g = gen("conv-garbage")
    rows = [row(5, 0, 3, False), row(2, 0, 5, True)]
    meta = meta_for(rows, conv_kernel=K)
    x = strided(g, meta.num_prefill_tokens, DIM)
    weight, bias = randn(g, DIM, K), randn(g, DIM)
    state0 = randn(g, NUM_SLOTS + 1, K - 1, DIM)
    state0[3] = float("nan")
    state0[3, 0, 0] = float("inf")
    conv_state = state0.clone()
    out = causal_conv1d_varlen(x, weight, bias, conv_state, meta.prefill.state_slots,
                               meta.prefill.has_initial_state, meta.prefill.conv_window_idx, meta.prefill.conv_state_idx)
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(conv_state[3]).all())
    assert finite, ("has_initial_state=False row produced NaN from the stale contents of its slot "
                    "(the initial window is masked by multiplying with 0, and NaN * 0 = NaN)")
    ref, window = naive_conv_row(x[:5], weight, bias, torch.zeros(K - 1, DIM))
    torch.testing.assert_close(out[:5], ref.float(), **TOL)
    assert torch.equal(conv_state[3], window.float())
