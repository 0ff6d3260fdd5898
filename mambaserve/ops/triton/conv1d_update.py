"""Triton decode kernel: one causal depthwise conv1d step per row, shifting the row's window.

Grid: (rows, cdiv(conv_dim, BLOCK_D)). A program reads the row's K-1 saved inputs
`conv_state[slot, :, d-block]` and the new input x, writes out = silu(sum_k w[d, k] * win[k] + b)
(float32 math) and stores the window shifted by one (the K-1 newest inputs) back into the slot.
A negative slot skips the row: the pool is neither read nor written and the output row is zero.
With `snap_dst` (prefix caching: a destination slot per row, -1 for none) the shifted window is
also stored into the row's destination slot, in the same pass (a reserved snapshot slot, never
a live row's: no program reads what another writes). Launch parameters: `tuning` entry
"conv1d_update".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, slot_ptr, snap_ptr, out_ptr,
    Dm,
    x_b, x_d, w_d, w_k, s_slot, s_k, s_d, o_b, o_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
    SHARED_LANES: tl.constexpr, SNAP: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    row = tl.program_id(0)
    db = tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    offs = db * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs < Dm
    mv = md & valid

    x = tl.load(x_ptr + row * x_b + offs * x_d, mask=md, other=0.0)
    win = state_ptr + slot * s_slot + offs * s_d
    acc = window_conv(x, w_ptr, b_ptr, win, offs, md, mv, w_d, w_k, s_k, K, HAS_BIAS, SILU)
    if SHARED_LANES:  # fewer channels than threads: a value is read by several warps and
        tl.debug_barrier()  # stored by one; all reads before the window moves
    snap, ms = win, mv
    if SNAP:  # the shifted window into the row's snapshot slot too
        dst = tl.load(snap_ptr + row).to(tl.int64)
        snap, ms = state_ptr + tl.maximum(dst, 0) * s_slot + offs * s_d, mv & (dst >= 0)
    shift_window(win, x, mv, s_k, K, snap, ms, SNAP)
    acc = tl.where(valid, acc, 0.0)
    tl.store(out_ptr + row * o_b + offs * o_d, acc.to(out_ptr.dtype.element_ty), mask=md)


@triton.jit
def window_conv(x, w_ptr, b_ptr, win, offs, md, mv, w_d, w_k, s_k, K: tl.constexpr,
                HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """float32 (silu of) the conv of channels `offs` over the row's saved window (`win`: the
    pointers of window[0], mask mv) and the new input x (x's dtype; window values cast to it,
    as the reference does)."""
    acc = x.to(tl.float32) * tl.load(w_ptr + offs * w_d + (K - 1) * w_k, mask=md,
                                     other=0.0).to(tl.float32)
    for k in tl.static_range(K - 1):
        w = tl.load(w_ptr + offs * w_d + k * w_k, mask=md, other=0.0).to(tl.float32)
        prev = tl.load(win + k * s_k, mask=mv, other=0.0)
        acc += prev.to(x.dtype).to(tl.float32) * w
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=md, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def shift_window(win, x, mv, s_k, K: tl.constexpr, snap, ms, SNAP: tl.constexpr):
    """The saved window of K-1 inputs at `win` shifted by one: the K-2 newest kept, x added;
    with SNAP the shifted window also stored at `snap` (mask ms)."""
    for k in tl.static_range(K - 2):
        v = tl.load(win + (k + 1) * s_k, mask=mv, other=0.0)
        tl.store(win + k * s_k, v, mask=mv)
        if SNAP:
            tl.store(snap + k * s_k, v, mask=ms)
    xs = x.to(win.dtype.element_ty)
    tl.store(win + (K - 2) * s_k, xs, mask=mv)
    if SNAP:
        tl.store(snap + (K - 2) * s_k, xs, mask=ms)


def causal_conv1d_update_triton(x, weight, bias, conv_state, state_slots, activation=True,
                                snap_dst=None):
    """Same contract as `mambaserve.ops.conv1d.causal_conv1d_update`."""
    Bt, Dm = x.shape
    Dw, K = weight.shape
    _, K1, Ds = conv_state.shape
    assert Dw == Dm and Ds == Dm, (x.shape, weight.shape, conv_state.shape)
    assert K1 == K - 1 and K >= 2, (K1, K)
    assert state_slots.shape == (Bt,) and state_slots.is_contiguous()
    assert bias is None or (bias.shape == (Dm,) and bias.is_contiguous())
    assert snap_dst is None or (snap_dst.shape == (Bt,) and snap_dst.is_contiguous())
    out = torch.empty((Bt, Dm), dtype=x.dtype, device=x.device)
    if Bt == 0:
        return out
    cfg = tuning.config("conv1d_update", x.device)
    block_d = cfg["block_d"]
    grid = (Bt, triton.cdiv(Dm, block_d))
    _conv_update_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, state_slots,
        snap_dst if snap_dst is not None else state_slots, out, Dm,
        *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
        K=K, HAS_BIAS=bias is not None, SILU=bool(activation), BLOCK_D=block_d,
        SHARED_LANES=block_d < 32 * cfg["num_warps"], SNAP=snap_dst is not None,
        num_warps=cfg["num_warps"],
        **pdl_launch(x.device, _conv_update_kernel),
    )
    return out
