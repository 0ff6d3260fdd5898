"""Triton prefill kernel: varlen causal depthwise conv1d over the flat multi-row token stream.

Two launches: a sliding-window conv over tiles of consecutive tokens (`_conv_varlen_kernel`),
then the write of each row's last K-1 inputs into its conv-state slot (`_conv_state_kernel`).
Kernel widths K = 2..5 (`mambaserve.ops.dispatch` sends other widths to the reference). The
algorithm, grids and measurements are in docs/kernels.md ("Prefill conv"); launch parameters are
the `tuning` entry "conv1d_varlen".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning


@triton.jit
def _ext_load(e, d, md, x_ptr, state_ptr, slot_ptr, init_ptr, RK1, x_t, x_d, s_slot, s_k, s_d,
              K1: tl.constexpr):
    """Values ext[e, d] of the extended stream; e: [M] int64, d: [BLOCK_D] -> [M, BLOCK_D]."""
    from_state = e < RK1
    r = tl.where(from_state, e // K1, 0)
    u = e % K1
    slot = tl.load(slot_ptr + r, mask=from_state, other=-1).to(tl.int64)
    use = from_state & (slot >= 0) & (tl.load(init_ptr + r, mask=from_state, other=0) != 0)
    slot = tl.maximum(slot, 0)
    sv = tl.load(state_ptr + slot[:, None] * s_slot + u[:, None] * s_k + d[None, :] * s_d,
                 mask=use[:, None] & md[None, :], other=0.0)
    xr = tl.where(from_state, 0, e - RK1)
    xv = tl.load(x_ptr + xr[:, None] * x_t + d[None, :] * x_d,
                 mask=(~from_state)[:, None] & md[None, :], other=0.0)
    return tl.where(from_state[:, None], sv.to(x_ptr.dtype.element_ty), xv)


@triton.jit
def _saved(prev, j: tl.constexpr, pos, sbase, s_k, md, use, K1: tl.constexpr):
    """The input at distance j before a head token at row offset `pos`: the register `prev`
    (x[t-j]) when it lies in the row, else the saved input conv_state[slot, K1 + pos - j]."""
    fs = j > pos
    sv = tl.load(sbase + (K1 + pos - j) * s_k, mask=md & use & fs, other=0.0)
    return tl.where(fs, sv.to(prev.dtype), prev)


@triton.jit
def _taps(bias, xt, p1, p2, p3, p4, w0, w1, w2, w3, w4, K1: tl.constexpr, SILU: tl.constexpr):
    """silu(bias + sum_j w_j * x[t - j]) in float32, oldest tap first; p_j = x[t - j]."""
    acc = bias
    if K1 >= 4:
        acc += w4 * p4.to(tl.float32)
    if K1 >= 3:
        acc += w3 * p3.to(tl.float32)
    if K1 >= 2:
        acc += w2 * p2.to(tl.float32)
    acc += w1 * p1.to(tl.float32)
    acc += w0 * xt.to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit(do_not_specialize=["T", "RK1"])
def _conv_varlen_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, init_ptr, win_ptr, out_ptr,
    T, Dm, RK1,
    x_t, x_d, w_d, w_k, s_slot, s_k, s_d, win_t, o_t, o_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNROLL: tl.constexpr,
    LOOKAHEAD: tl.constexpr,
):
    K1: tl.constexpr = K - 1
    tl.static_assert(K >= 2 and K <= 5)
    tl.static_assert(LOOKAHEAD >= 0 and LOOKAHEAD <= 4)
    t0 = tl.program_id(0).to(tl.int64) * BLOCK_T
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dm
    xd = x_ptr + d * x_d
    od = out_ptr + d * o_d
    wd = w_ptr + d * w_d
    # weight of distance j (tap K-1-j) and the window p_j = x[t - j] (raw inputs, zero before
    # token 0); distances past K-1 are zeros, never used
    w0 = tl.load(wd + K1 * w_k, mask=md, other=0.0).to(tl.float32)
    w1 = tl.load(wd + (K1 - 1) * w_k, mask=md, other=0.0).to(tl.float32)
    w2 = tl.load(wd + (K1 - 2) * w_k, mask=md & (K1 >= 2), other=0.0).to(tl.float32)
    w3 = tl.load(wd + (K1 - 3) * w_k, mask=md & (K1 >= 3), other=0.0).to(tl.float32)
    w4 = tl.load(wd + (K1 - 4) * w_k, mask=md & (K1 >= 4), other=0.0).to(tl.float32)
    p1 = tl.load(xd + (t0 - 1) * x_t, mask=md & (t0 >= 1), other=0.0)
    p2 = tl.load(xd + (t0 - 2) * x_t, mask=md & (t0 >= 2) & (K1 >= 2), other=0.0)
    p3 = tl.load(xd + (t0 - 3) * x_t, mask=md & (t0 >= 3) & (K1 >= 3), other=0.0)
    p4 = tl.load(xd + (t0 - 4) * x_t, mask=md & (t0 >= 4) & (K1 >= 4), other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    tt = t0 + tl.arange(0, BLOCK_T)
    e0s = tl.load(win_ptr + tt * win_t, mask=tt < T, other=RK1)
    if tl.min(e0s, axis=0) >= RK1:
        # no token of the tile is among its row's first K-1: every tap is in x
        if UNROLL:
            # the next LOOKAHEAD inputs are loaded ahead (a1..a4), so that several loads are in
            # flight while a token is computed and stored
            t_end = tl.minimum(t0 + BLOCK_T, T)
            a1 = tl.load(xd + t0 * x_t, mask=md & (t0 < t_end) & (LOOKAHEAD >= 1), other=0.0)
            a2 = tl.load(xd + (t0 + 1) * x_t, mask=md & (t0 + 1 < t_end) & (LOOKAHEAD >= 2),
                         other=0.0)
            a3 = tl.load(xd + (t0 + 2) * x_t, mask=md & (t0 + 2 < t_end) & (LOOKAHEAD >= 3),
                         other=0.0)
            a4 = tl.load(xd + (t0 + 3) * x_t, mask=md & (t0 + 3 < t_end) & (LOOKAHEAD >= 4),
                         other=0.0)
            for i in tl.static_range(BLOCK_T):
                t = t0 + i
                if LOOKAHEAD == 0:
                    xt = tl.load(xd + t * x_t, mask=md & (t < T), other=0.0)
                else:
                    xt = a1
                    nxt = tl.load(xd + (t + LOOKAHEAD) * x_t,
                                  mask=md & (t + LOOKAHEAD < t_end), other=0.0)
                    if LOOKAHEAD == 1:
                        a1 = nxt
                    elif LOOKAHEAD == 2:
                        a1 = a2
                        a2 = nxt
                    elif LOOKAHEAD == 3:
                        a1 = a2
                        a2 = a3
                        a3 = nxt
                    else:
                        a1 = a2
                        a2 = a3
                        a3 = a4
                        a4 = nxt
                acc = _taps(bias, xt, p1, p2, p3, p4, w0, w1, w2, w3, w4, K1, SILU)
                tl.store(od + t * o_t, acc.to(out_ptr.dtype.element_ty), mask=md & (t < T))
                p4 = p3
                p3 = p2
                p2 = p1
                p1 = xt
        else:
            for i in range(BLOCK_T):
                t = t0 + i
                xt = tl.load(xd + t * x_t, mask=md & (t < T), other=0.0)
                acc = _taps(bias, xt, p1, p2, p3, p4, w0, w1, w2, w3, w4, K1, SILU)
                tl.store(od + t * o_t, acc.to(out_ptr.dtype.element_ty), mask=md & (t < T))
                p4 = p3
                p3 = p2
                p2 = p1
                p1 = xt
    else:
        for i in range(BLOCK_T):
            t = t0 + i
            xt = tl.load(xd + t * x_t, mask=md & (t < T), other=0.0)
            e0 = tl.load(win_ptr + t * win_t, mask=t < T, other=RK1)
            q1 = p1
            q2 = p2
            q3 = p3
            q4 = p4
            if e0 < RK1:  # among the row's first K-1 tokens: taps before the row start saved
                pos = e0 % K1
                r = e0 // K1
                slot = tl.load(slot_ptr + r).to(tl.int64)
                use = (slot >= 0) & (tl.load(init_ptr + r) != 0)
                sbase = state_ptr + tl.maximum(slot, 0) * s_slot + d * s_d
                q1 = _saved(p1, 1, pos, sbase, s_k, md, use, K1)
                if K1 >= 2:
                    q2 = _saved(p2, 2, pos, sbase, s_k, md, use, K1)
                if K1 >= 3:
                    q3 = _saved(p3, 3, pos, sbase, s_k, md, use, K1)
                if K1 >= 4:
                    q4 = _saved(p4, 4, pos, sbase, s_k, md, use, K1)
            acc = _taps(bias, xt, q1, q2, q3, q4, w0, w1, w2, w3, w4, K1, SILU)
            tl.store(od + t * o_t, acc.to(out_ptr.dtype.element_ty), mask=md & (t < T))
            p4 = p3
            p3 = p2
            p2 = p1
            p1 = xt


@triton.jit(do_not_specialize=["RK1"])
def _conv_state_kernel(
    x_ptr, state_ptr, slot_ptr, init_ptr, sidx_ptr, Dm, RK1,
    x_t, x_d, s_slot, s_k, s_d, sidx_r,
    K1: tl.constexpr, K1_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    md = d < Dm
    u = tl.arange(0, K1_PAD)
    mu = u < K1
    e = tl.load(sidx_ptr + r * sidx_r + u, mask=mu, other=RK1)
    v = _ext_load(e, d, md, x_ptr, state_ptr, slot_ptr, init_ptr, RK1, x_t, x_d, s_slot, s_k,
                  s_d, K1)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    tl.debug_barrier()  # every old saved input of this slot is read before any is overwritten
    tl.store(state_ptr + tl.maximum(slot, 0) * s_slot + u[:, None] * s_k + d[None, :] * s_d,
             v.to(state_ptr.dtype.element_ty), mask=(mu[:, None] & md[None, :]) & (slot >= 0))


def causal_conv1d_varlen_triton(x, weight, bias, conv_state, state_slots, has_initial_state,
                                conv_window_idx, conv_state_idx, activation=True):
    """Same contract as `mambaserve.ops.conv1d.causal_conv1d_varlen`, for widths K = 2..5 (the
    window is held in named registers). `conv_window_idx` must come from `build_metadata` (each
    window is K consecutive virtual positions of its row); only its column 0 is read."""
    T, Dm = x.shape
    Dw, K = weight.shape
    _, K1, Ds = conv_state.shape
    R = state_slots.shape[0]
    assert Dw == Dm and Ds == Dm and K1 == K - 1, (x.shape, weight.shape, conv_state.shape)
    assert 2 <= K <= 5, f"conv width {K}: the kernel takes 2..5"
    assert has_initial_state.shape == (R,) and conv_state_idx.shape == (R, K1)
    assert conv_window_idx.shape == (T, K)
    assert bias is None or (bias.shape == (Dm,) and bias.is_contiguous())
    for t in (state_slots, has_initial_state, conv_window_idx, conv_state_idx):
        assert t.is_contiguous()
    out = torch.empty((T, Dm), dtype=x.dtype, device=x.device)
    if T == 0 or R == 0:
        return out
    cfg = tuning.config("conv1d_varlen", x.device)
    block_t, block_d, state_block_d = cfg["block_t"], cfg["block_d"], cfg["state_block_d"]
    RK1 = R * K1
    _conv_varlen_kernel[(triton.cdiv(T, block_t), triton.cdiv(Dm, block_d))](
        x, weight, bias if bias is not None else weight, conv_state, state_slots,
        has_initial_state, conv_window_idx, out, T, Dm, RK1,
        *x.stride(), *weight.stride(), *conv_state.stride(), conv_window_idx.stride(0),
        *out.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=bool(activation), BLOCK_T=block_t, BLOCK_D=block_d,
        UNROLL=bool(cfg["unroll"]), LOOKAHEAD=cfg["lookahead"], num_warps=cfg["num_warps"],
    )
    _conv_state_kernel[(R, triton.cdiv(Dm, state_block_d))](
        x, conv_state, state_slots, has_initial_state, conv_state_idx, Dm, RK1,
        *x.stride(), *conv_state.stride(), conv_state_idx.stride(0),
        K1=K1, K1_PAD=triton.next_power_of_2(K1), BLOCK_D=state_block_d,
        num_warps=cfg["state_num_warps"],
    )
    return out
