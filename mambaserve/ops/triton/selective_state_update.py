"""Triton decode kernel: one Mamba2 selective-state-update step per row, in place on the pool.

Grid: (rows, heads, cdiv(head_dim, BLOCK_P)). Each program owns a [BLOCK_P, N] tile of one head's
state: it reads the tile once from `ssm_state[slot]` (any float dtype, math in float32), updates
it, writes it back, and reduces it against C for y. B/C of head h come from group h // (H / G).
A negative slot skips the row: nothing is read from or written to the pool and y is zero.
With `snap_dst` (prefix caching: a destination slot per row, -1 for none) the updated tile is
also stored into the row's destination slot in the same pass (a reserved snapshot slot, never a
live row's). Launch parameters: `tuning` entry "selective_state_update".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch, softplus_clamp


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, snap_ptr, y_ptr,
    dt_lo, dt_hi, P, N, heads_per_group,
    s_slot, s_h, s_p, s_n,
    x_b, x_h, x_p,
    dt_b, dt_h,
    B_b, B_g, B_n,
    C_b, C_g, C_n,
    y_b, y_h, y_p,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, SHARED_LANES: tl.constexpr,
    SNAP: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    row = tl.program_id(0)
    h = tl.program_id(1)
    g = h // heads_per_group
    slot = tl.load(slot_ptr + row).to(tl.int64)
    valid = slot >= 0
    slot = tl.maximum(slot, 0)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = (offs_p < P) & valid
    mn = (offs_n < N) & valid
    m2 = mp[:, None] & mn[None, :]

    s_ptrs = state_ptr + slot * s_slot + h * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n
    x = tl.load(x_ptr + row * x_b + h * x_h + offs_p * x_p, mask=mp, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + row * B_b + g * B_g + offs_n * B_n, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + row * C_b + g * C_g + offs_n * C_n, mask=mn, other=0.0).to(tl.float32)
    dt_raw = tl.load(dt_ptr + row * dt_b + h * dt_h).to(tl.float32)
    state = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    dt = softplus_clamp(dt_raw + tl.load(dt_bias_ptr + h).to(tl.float32), dt_lo, dt_hi)
    A = tl.load(A_ptr + h).to(tl.float32)
    Dh = tl.load(D_ptr + h).to(tl.float32)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    if SHARED_LANES:  # a tile smaller than the program: its values are held (and loaded) by
        tl.debug_barrier()  # several warps, stored by one; every load before the first store
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=m2)
    if SNAP:  # the new state into the row's snapshot slot too
        dst = tl.load(snap_ptr + row).to(tl.int64)
        tl.store(s_ptrs + (tl.maximum(dst, 0) - slot) * s_slot,
                 state.to(state_ptr.dtype.element_ty), mask=m2 & (dst >= 0))
    y = tl.sum(state * Cv[None, :], axis=1) + Dh * x
    y = tl.where(valid, y, 0.0)
    tl.store(y_ptr + row * y_b + h * y_h + offs_p * y_p, y.to(y_ptr.dtype.element_ty),
             mask=offs_p < P)


def launch_plan(P: int, N: int, device) -> tuple[int, int]:
    """(block_p, num_warps) of a head's [P, N] state: the tuning entry "selective_state_update"
    with its None knobs resolved (block_p max(1, min(pow2(P), 4096 // pow2(N), 16)); num_warps 4
    when block_p * pow2(N) >= 2048, else 2)."""
    cfg = tuning.config("selective_state_update", device)
    block_n = triton.next_power_of_2(N)
    block_p, num_warps = cfg["block_p"], cfg["num_warps"]
    if block_p is None:
        block_p = max(1, min(triton.next_power_of_2(P), 4096 // block_n, 16))
    if num_warps is None:
        num_warps = 4 if block_p * block_n >= 2048 else 2
    return block_p, num_warps


def selective_state_update_triton(ssm_state, x, dt, A, B, C, D, dt_bias, dt_limit, state_slots,
                                  snap_dst=None):
    """Same contract as `mambaserve.ops.selective_state_update.selective_state_update`."""
    Bt, H, P = x.shape
    _, H2, P2, N = ssm_state.shape
    G = B.shape[1]
    assert (H2, P2) == (H, P), f"ssm_state {tuple(ssm_state.shape)} vs x {tuple(x.shape)}"
    assert dt.shape == (Bt, H), dt.shape
    assert B.shape == (Bt, G, N) and C.shape == (Bt, G, N), (B.shape, C.shape)
    assert A.shape == (H,) and D.shape == (H,) and dt_bias.shape == (H,)
    assert H % G == 0, "heads must split evenly over groups"
    assert state_slots.shape == (Bt,)
    assert A.is_contiguous() and D.is_contiguous() and dt_bias.is_contiguous()
    assert state_slots.is_contiguous()
    assert snap_dst is None or (snap_dst.shape == (Bt,) and snap_dst.is_contiguous())
    y = torch.empty((Bt, H, P), dtype=x.dtype, device=x.device)
    if Bt == 0:
        return y
    BLOCK_N = triton.next_power_of_2(N)
    block_p, num_warps = launch_plan(P, N, x.device)
    grid = (Bt, H, triton.cdiv(P, block_p))
    _ssu_kernel[grid](
        ssm_state, x, dt, A, B, C, D, dt_bias, state_slots,
        snap_dst if snap_dst is not None else state_slots, y,
        float(dt_limit[0]), float(dt_limit[1]), P, N, H // G,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        BLOCK_P=block_p, BLOCK_N=BLOCK_N, SHARED_LANES=block_p * BLOCK_N < 32 * num_warps,
        SNAP=snap_dst is not None,
        num_warps=num_warps, **pdl_launch(x.device, _ssu_kernel),
    )
    return y
