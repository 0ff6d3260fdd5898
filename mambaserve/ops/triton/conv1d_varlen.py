"""Triton prefill kernel: varlen causal depthwise conv1d over the flat multi-row token stream.

Uses the host-built gather indices of the reference (`conv_window_idx` [T, K] and `conv_state_idx`
[R, K-1] into the "extended" stream: each row's K-1 saved inputs, then the T new tokens), without
materializing that stream. Two launches:

1. `_conv_varlen_kernel`, grid (cdiv(T, BLOCK_T), cdiv(conv_dim, BLOCK_D)): for each token and tap,
   reads either x[t'] or the row's saved input conv_state[slot, u] (zero when the row has no
   initial state or a negative slot: a masked load, so stale NaNs in a fresh slot cannot leak),
   out = silu(sum_k w[d, k] * win[k] + b) in float32.
2. `_conv_state_kernel`, grid (rows, cdiv(conv_dim, BLOCK_D)), launched after 1 (which reads the
   old states): writes the row's last K-1 inputs into conv_state[slot] (nothing for a negative
   slot). All K-1 values are loaded before a CTA barrier and stored after it, since a row shorter
   than K-1 tokens moves old saved inputs within its own slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _conv_varlen_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, init_ptr, win_ptr, out_ptr,
    T, Dm, RK1,
    x_t, x_d, w_d, w_k, s_slot, s_k, s_d, win_t, o_t, o_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mt = t < T
    md = d < Dm
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):
        e = tl.load(win_ptr + t * win_t + k, mask=mt, other=RK1)  # masked rows read x[0]
        v = _ext_load(e, d, md, x_ptr, state_ptr, slot_ptr, init_ptr, RK1, x_t, x_d, s_slot,
                      s_k, s_d, K - 1)
        w = tl.load(w_ptr + d * w_d + k * w_k, mask=md, other=0.0).to(tl.float32)
        acc += v.to(tl.float32) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + d, mask=md, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * o_t + d[None, :] * o_d, acc.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & md[None, :])


@triton.jit
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
                                conv_window_idx, conv_state_idx, activation=True, *,
                                block_t: int = 32, block_d: int = 128, num_warps: int = 4):
    """Same contract as `mambaserve.ops.conv1d.causal_conv1d_varlen`."""
    T, Dm = x.shape
    Dw, K = weight.shape
    _, K1, Ds = conv_state.shape
    R = state_slots.shape[0]
    assert Dw == Dm and Ds == Dm and K1 == K - 1 and K >= 2, (x.shape, weight.shape,
                                                              conv_state.shape)
    assert has_initial_state.shape == (R,) and conv_state_idx.shape == (R, K1)
    assert conv_window_idx.shape == (T, K)
    assert bias is None or (bias.shape == (Dm,) and bias.is_contiguous())
    for t in (state_slots, has_initial_state, conv_window_idx, conv_state_idx):
        assert t.is_contiguous()
    out = torch.empty((T, Dm), dtype=x.dtype, device=x.device)
    if T == 0 or R == 0:
        return out
    RK1 = R * K1
    _conv_varlen_kernel[(triton.cdiv(T, block_t), triton.cdiv(Dm, block_d))](
        x, weight, bias if bias is not None else weight, conv_state, state_slots,
        has_initial_state, conv_window_idx, out, T, Dm, RK1,
        *x.stride(), *weight.stride(), *conv_state.stride(), conv_window_idx.stride(0),
        *out.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=bool(activation), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=num_warps,
    )
    _conv_state_kernel[(R, triton.cdiv(Dm, 256))](
        x, conv_state, state_slots, has_initial_state, conv_state_idx, Dm, RK1,
        *x.stride(), *conv_state.stride(), conv_state_idx.stride(0),
        K1=K1, K1_PAD=triton.next_power_of_2(K1), BLOCK_D=256, num_warps=4,
    )
    return out
