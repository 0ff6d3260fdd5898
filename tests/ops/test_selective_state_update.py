"""selective_state_update vs one (or several) steps of the Mamba2 recurrence
(tests/ops/naive.py), and the prefill -> decode hand-off through the shared state pool."""

from __future__ import annotations

import math

import pytest
import torch
from naive import gen, meta_for, naive_ssm_row, randn, row, ssm_params

from mambaserve.ops.selective_state_update import selective_state_update
from mambaserve.ops.ssd import ssd_chunk_scan_varlen

TOL = {"rtol": 1e-5, "atol": 1e-5}
NUM_SLOTS = 9  # + 1 scratch

SHAPES = [(4, 8, 2, 16), (2, 4, 1, 8), (4, 4, 4, 8), (6, 2, 3, 4)]  # H, P, G, N


@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.01, 0.1)], ids=["nolimit", "clamped"])
@pytest.mark.parametrize("H,P,G,N", SHAPES)
def test_one_step_matches_recurrence(H, P, G, N, dt_limit):
    g = gen("ssu", H, P, G, N, dt_limit)
    slots = torch.randperm(NUM_SLOTS, generator=g)[:5].tolist()
    decodes = [row(1, 7 + i, s, True) for i, s in enumerate(slots)]
    decodes.insert(3, row(1, 4, -1, True))  # padding row
    meta = meta_for([], decodes)
    Bt = meta.num_decodes
    x, B, C = randn(g, Bt, H, P), randn(g, Bt, G, N), randn(g, Bt, G, N)
    dt_raw, dt_bias, A, D = ssm_params(g, Bt, H)
    state0 = randn(g, NUM_SLOTS + 1, H, P, N)
    ssm_state = state0.clone()

    y = selective_state_update(ssm_state, x, dt_raw, A, B, C, D, dt_bias, dt_limit,
                               meta.decode_state_slots)
    assert y.shape == (Bt, H, P) and y.dtype == torch.float32
    for i, r in enumerate(decodes):
        if r.state_slot < 0:
            continue
        y_ref, states = naive_ssm_row(x[i:i + 1], dt_raw[i:i + 1], A, B[i:i + 1], C[i:i + 1], D,
                                      dt_bias, dt_limit, state0[r.state_slot])
        torch.testing.assert_close(y[i], y_ref[0].float(), **TOL)
        torch.testing.assert_close(ssm_state[r.state_slot], states[0].float(), **TOL)
    for s in range(NUM_SLOTS):
        if s not in slots:
            assert torch.equal(ssm_state[s], state0[s]), f"slot {s} was modified"


def test_many_steps_match_recurrence():
    """Ten decode steps of three requests (batch order changing between steps)."""
    H, P, G, N, steps = 4, 4, 2, 8, 10
    g = gen("ssu-steps")
    slots = [5, 0, 7]
    xs, Bs, Cs = randn(g, steps, 3, H, P), randn(g, steps, 3, G, N), randn(g, steps, 3, G, N)
    dt_raw, dt_bias, A, D = ssm_params(g, steps * 3, H)
    dt_raw = dt_raw.view(steps, 3, H)
    state0 = randn(g, NUM_SLOTS + 1, H, P, N)
    ssm_state = state0.clone()
    ys = torch.empty(steps, 3, H, P)
    for t in range(steps):
        perm = torch.randperm(3, generator=g)
        meta = meta_for([], [row(1, t, slots[i], True) for i in perm.tolist()])
        y = selective_state_update(ssm_state, xs[t, perm], dt_raw[t, perm], A, Bs[t, perm],
                                   Cs[t, perm], D, dt_bias, (0.0, math.inf),
                                   meta.decode_state_slots)
        ys[t, perm] = y
    for i, s in enumerate(slots):
        y_ref, states = naive_ssm_row(xs[:, i], dt_raw[:, i], A, Bs[:, i], Cs[:, i], D, dt_bias,
                                      (0.0, math.inf), state0[s])
        torch.testing.assert_close(ys[:, i], y_ref.float(), **TOL)
        torch.testing.assert_close(ssm_state[s], states[-1].float(), **TOL)


@pytest.mark.parametrize("cs", [4, 8])
def test_prefill_then_decode_continues_the_recurrence(cs):
    """Prefill with ssd_chunk_scan_varlen, then decode with selective_state_update from the same
    slot (a mixed batch: the second forward also prefills another request): the decode outputs
    continue the same recurrence."""
    H, P, G, N = 4, 4, 2, 8
    g = gen("ssu-handoff", cs)
    n_prefill, n_decode, slot_a, slot_b = 11, 3, 6, 2
    n = n_prefill + n_decode
    x, B, C = randn(g, n, H, P), randn(g, n, G, N), randn(g, n, G, N)
    dt_raw, dt_bias, A, D = ssm_params(g, n, H)
    lim = (0.0, math.inf)
    ssm_state = randn(g, NUM_SLOTS + 1, H, P, N)

    meta = meta_for([row(n_prefill, 0, slot_a, False)], chunk_size=cs)
    y_pre = ssd_chunk_scan_varlen(
        x[:n_prefill], dt_raw[:n_prefill], A, B[:n_prefill], C[:n_prefill], D, dt_bias, lim,
        ssm_state, meta.prefill.state_slots, meta.prefill.has_initial_state, meta.prefill.chunk_token_idx,
        meta.prefill.token_chunk_pos, meta.prefill.row_chunks, meta.prefill.row_num_chunks)
    y_dec = []
    for t in range(n_prefill, n):
        # another request (slot_b, 3 tokens, fresh) prefills in the same forward
        meta = meta_for([row(3, 0, slot_b, False)], [row(1, t, slot_a, True)], chunk_size=cs)
        xo, Bo, Co = randn(g, 3, H, P), randn(g, 3, G, N), randn(g, 3, G, N)
        dto = randn(g, 3, H)
        ssd_chunk_scan_varlen(xo, dto, A, Bo, Co, D, dt_bias, lim, ssm_state,
                              meta.prefill.state_slots, meta.prefill.has_initial_state,
                              meta.prefill.chunk_token_idx, meta.prefill.token_chunk_pos, meta.prefill.row_chunks,
                              meta.prefill.row_num_chunks)
        y_dec.append(selective_state_update(ssm_state, x[t:t + 1], dt_raw[t:t + 1], A,
                                            B[t:t + 1], C[t:t + 1], D, dt_bias, lim,
                                            meta.decode_state_slots))
    y_ref, states = naive_ssm_row(x, dt_raw, A, B, C, D, dt_bias, lim, torch.zeros(H, P, N))
    torch.testing.assert_close(y_pre, y_ref[:n_prefill].float(), **TOL)
    torch.testing.assert_close(torch.cat(y_dec), y_ref[n_prefill:].float(), **TOL)
    torch.testing.assert_close(ssm_state[slot_a], states[-1].float(), **TOL)
