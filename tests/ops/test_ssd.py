"""ssd_chunk_scan_varlen vs the sequential Mamba2 recurrence (tests/ops/naive.py), with inputs
indexed by the real build_metadata."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from naive import gen, meta_for, naive_ssm_row, randn, row, row_spans, ssm_params

from mambaserve.ops.ssd import ssd_chunk_scan_varlen

TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_SLOTS = 12  # + 1 scratch


def rows_for(cs: int, slots: list[int]):
    """Rows of lengths 1, cs-1, cs, 3cs+5 with aligned / unaligned prefixes, with and without an
    initial state."""
    specs = [  # (n, context_len, has_initial_state)
        (3 * cs + 5, 0, False),
        (1, cs + 2, True),           # one token mid-chunk
        (cs - 1, 0, False),
        (cs, 3, True),               # short first chunk (cs - 3 tokens) then 3
        (3 * cs + 5, 2 * cs - 1, True),  # first chunk holds a single token
        (cs, 2 * cs, True),          # aligned prefix
        (cs - 1, 5, False),          # prefix cut but started from zero (the flag decides)
        (1, 0, False),
    ]
    return [row(n, ctx, slots[i], init) for i, (n, ctx, init) in enumerate(specs)]


def make_inputs(g, T, H, P, G, N):
    x = randn(g, T, H, P)
    B, C = randn(g, T, G, N), randn(g, T, G, N)
    dt_raw, dt_bias, A, D = ssm_params(g, T, H)
    return x, dt_raw, A, B, C, D, dt_bias


def run_ssd(meta, ins, dt_limit, ssm_state):
    """(y, every chunk's end state): the end states through the op's snapshots, into slots of
    a larger pool (ssm_state's real slots, one per chunk, then its scratch slot) whose real and
    scratch slots are copied back into ssm_state."""
    x, dt_raw, A, B, C, D, dt_bias = ins
    pf, n = meta.prefill, ssm_state.shape[0] - 1
    pool = torch.cat([ssm_state[:n], ssm_state.new_zeros(pf.num_chunks, *ssm_state.shape[1:]),
                      ssm_state[n:]])
    y = ssd_chunk_scan_varlen(
        x, dt_raw, A, B, C, D, dt_bias, dt_limit, pool, pf.state_slots, pf.has_initial_state,
        pf.chunk_token_idx, pf.token_chunk_pos, pf.row_chunks, pf.row_num_chunks,
        torch.arange(n, n + pf.num_chunks))
    ssm_state[:n], ssm_state[n:] = pool[:n], pool[-1:]
    return y, pool[n:n + pf.num_chunks]


def naive_rows(rows, ins, dt_limit, state0):
    """Per row: (y [n,H,P], states [n,H,P,N]) from the sequential recurrence."""
    x, dt_raw, A, B, C, D, dt_bias = ins
    H, P, N = state0.shape[1:]
    out = []
    for r, (s, e) in zip(rows, row_spans(rows)):
        h0 = state0[r.state_slot] if r.has_initial_state else torch.zeros(H, P, N)
        out.append(naive_ssm_row(x[s:e], dt_raw[s:e], A, B[s:e], C[s:e], D, dt_bias, dt_limit,
                                 h0))
    return out


SHAPES = [  # H, P, G, N
    (4, 8, 2, 16),
    (2, 4, 1, 8),   # G = 1
    (4, 4, 4, 8),   # G = H
    (6, 2, 3, 4),
]


@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.01, 0.1)], ids=["nolimit", "clamped"])
@pytest.mark.parametrize("cs", [4, 8])
@pytest.mark.parametrize("H,P,G,N", SHAPES)
def test_ssd_matches_recurrence(H, P, G, N, cs, dt_limit):
    g = gen("ssd", H, P, G, N, cs, dt_limit)
    slots = torch.randperm(NUM_SLOTS, generator=g).tolist()
    rows = rows_for(cs, slots)
    meta = meta_for(rows, chunk_size=cs)
    T = meta.num_prefill_tokens
    ins = make_inputs(g, T, H, P, G, N)
    state0 = randn(g, NUM_SLOTS + 1, H, P, N)
    ssm_state = state0.clone()

    y, chunk_end_states = run_ssd(meta, ins, dt_limit, ssm_state)
    ref = naive_rows(rows, ins, dt_limit, state0)

    assert y.shape == (T, H, P) and y.dtype == torch.float32
    y_ref = torch.cat([yr for yr, _ in ref])
    torch.testing.assert_close(y, y_ref.float(), **TOL)

    # final state of each row in its slot; every other slot (and the scratch) untouched
    for r, (_, states) in zip(rows, ref):
        torch.testing.assert_close(ssm_state[r.state_slot], states[-1].float(), **TOL)
    used = {r.state_slot for r in rows}
    for s in range(NUM_SLOTS + 1):
        if s not in used:
            assert torch.equal(ssm_state[s], state0[s]), f"slot {s} was modified"

    # chunk_end_states[c] = the naive state after the last token of chunk c
    assert chunk_end_states.shape == (meta.prefill.num_chunks, H, P, N)
    starts = [s for s, _ in row_spans(rows)]
    idx = meta.prefill.chunk_token_idx
    for c in range(meta.prefill.num_chunks):
        toks = idx[c][idx[c] < T]
        last = int(toks[-1])
        r = int(meta.token_row[last])
        torch.testing.assert_close(chunk_end_states[c], ref[r][1][last - starts[r]].float(),
                                   **TOL)


@pytest.mark.parametrize("cs", [4, 8])
def test_ssd_chunk_plan(cs):
    """The chunk grid the op consumes: each chunk is a contiguous run of ONE row's tokens, a row's
    chunks cover it in order, and every chunk but a row's last ends at an absolute multiple of cs."""
    rows = rows_for(cs, list(range(8)))
    meta = meta_for(rows, chunk_size=cs)
    T = meta.num_prefill_tokens
    idx, pos = meta.prefill.chunk_token_idx, meta.positions
    seen = []
    for r, (s, e) in enumerate(row_spans(rows)):
        ids = meta.prefill.row_chunks[r, : int(meta.prefill.row_num_chunks[r])].tolist()
        assert (meta.prefill.row_chunks[r, len(ids):] == meta.prefill.num_chunks).all()
        covered = []
        for j, c in enumerate(ids):
            toks = idx[c][idx[c] < T].tolist()
            assert toks and toks == list(range(toks[0], toks[0] + len(toks)))
            assert (idx[c][len(toks):] == T).all(), "padding must trail"
            assert {int(meta.token_row[t]) for t in toks} == {r}, f"chunk {c} mixes rows"
            if j < len(ids) - 1:
                assert (int(pos[toks[-1]]) + 1) % cs == 0, "inner chunk end not aligned"
            assert int(pos[toks[0]]) // cs == int(pos[toks[-1]]) // cs, "chunk crosses boundary"
            # token_chunk_pos points back into the grid
            assert meta.prefill.token_chunk_pos[toks].tolist() == [c * cs + i for i in range(len(toks))]
            covered += toks
        assert covered == list(range(s, e))
        seen += ids
    assert sorted(seen) == list(range(meta.prefill.num_chunks))


def test_ssd_negative_slot_uses_scratch_only():
    """Padding rows (slot -1, with or without an initial state) touch no real slot; the real
    rows of the same batch are still exact."""
    H, P, G, N, cs = 4, 4, 2, 8, 4
    g = gen("ssd-neg")
    rows = [row(9, 0, 3, False), row(5, 2, -1, True), row(6, 0, 0, True), row(3, 6, -1, False)]
    meta = meta_for(rows, chunk_size=cs)
    ins = make_inputs(g, meta.num_prefill_tokens, H, P, G, N)
    state0 = randn(g, NUM_SLOTS + 1, H, P, N)
    ssm_state = state0.clone()
    y, _ = run_ssd(meta, ins, (0.0, math.inf), ssm_state)
    ref = naive_rows(rows, ins, (0.0, math.inf), state0)
    spans = row_spans(rows)
    for i in (0, 2):
        s, e = spans[i]
        torch.testing.assert_close(y[s:e], ref[i][0].float(), **TOL)
        torch.testing.assert_close(ssm_state[rows[i].state_slot], ref[i][1][-1].float(), **TOL)
    for s in range(NUM_SLOTS):
        if s not in (3, 0):
            assert torch.equal(ssm_state[s], state0[s]), f"padding row wrote real slot {s}"


def test_ssd_chunked_prefill_equals_one_shot():
    """A row fed in three forwards (context_len + has_initial_state continuing from its slot)
    gives the same outputs, final state and aligned chunk-end states as one forward."""
    H, P, G, N, cs = 4, 4, 2, 8, 8
    g = gen("ssd-chunked")
    n_total, cuts = 29, [0, 5, 19, 29]
    ins = make_inputs(g, n_total, H, P, G, N)
    slot = 2

    one_state = torch.zeros(NUM_SLOTS + 1, H, P, N)
    meta1 = meta_for([row(n_total, 0, slot, False)], chunk_size=cs)
    y1, ends1 = run_ssd(meta1, ins, (0.0, math.inf), one_state)

    st = torch.zeros(NUM_SLOTS + 1, H, P, N)
    ys, aligned = [], {}
    for a, b in itertools.pairwise(cuts):
        m = meta_for([row(b - a, a, slot, a > 0)], chunk_size=cs)
        x, dt_raw, A, B, C, D, dt_bias = ins
        part = (x[a:b], dt_raw[a:b], A, B[a:b], C[a:b], D, dt_bias)
        yp, ends = run_ssd(m, part, (0.0, math.inf), st)
        ys.append(yp)
        for c in range(m.prefill.num_chunks):  # chunk end position -> state
            toks = m.prefill.chunk_token_idx[c][m.prefill.chunk_token_idx[c] < b - a]
            aligned[int(m.positions[int(toks[-1])])] = ends[c]
    torch.testing.assert_close(torch.cat(ys), y1, **TOL)
    torch.testing.assert_close(st[slot], one_state[slot], **TOL)
    for c in range(meta1.prefill.num_chunks):
        idx = meta1.prefill.chunk_token_idx[c]
        end_pos = int(meta1.positions[int(idx[idx < n_total][-1])])
        torch.testing.assert_close(aligned[end_pos], ends1[c], **TOL)
    # and both equal the recurrence
    y_ref, _ = naive_ssm_row(*ins, (0.0, math.inf), torch.zeros(H, P, N))
    torch.testing.assert_close(y1, y_ref.float(), **TOL)


def test_ssd_fresh_row_ignores_garbage_in_its_slot():
    """StatePool: "a free slot's contents: garbage; a new request starts with has_initial_state =
    False". A fresh row must therefore not depend on what its slot holds, even non-finite values
    a previous occupant left behind."""
    H, P, G, N, cs = 2, 4, 1, 8, 4
    g = gen("ssd-garbage")
    rows = [row(6, 0, 1, False), row(3, 0, 4, True)]
    meta = meta_for(rows, chunk_size=cs)
    ins = make_inputs(g, meta.num_prefill_tokens, H, P, G, N)
    state0 = randn(g, NUM_SLOTS + 1, H, P, N)
    state0[1] = float("nan")
    state0[1, 0, 0, 0] = float("inf")
    ssm_state = state0.clone()
    y, _ = run_ssd(meta, ins, (0.0, math.inf), ssm_state)
    ref = naive_rows(rows, ins, (0.0, math.inf), state0)
    finite = bool(torch.isfinite(y).all()) and bool(torch.isfinite(ssm_state[1]).all())
    assert finite, (
        "has_initial_state=False row produced NaN from the stale contents of its slot "
        "(the initial state is masked by multiplying with 0, and NaN * 0 = NaN)")
    torch.testing.assert_close(y, torch.cat([r[0] for r in ref]).float(), **TOL)
