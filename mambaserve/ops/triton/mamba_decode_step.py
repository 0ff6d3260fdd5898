"""Triton decode kernel: a Mamba2 layer's conv step and state update in ONE launch, per row, in
place on the pools: what `conv1d_update.py` followed by `selective_state_update.py` compute, bit
for bit, without the conv output's round trip through memory or the second launch.

Grid: (rows, heads, cdiv(head_dim, BLOCK_P)), the state update's. A program convolves its own
BLOCK_P x channels (and shifts their saved windows), convolves the N B and N C channels of its
head's group from their saved windows (each of the group's programs does this: a few hundred
FMAs), rounds the conv outputs to the input dtype as the conv launch stores them, and steps its
[BLOCK_P, N] state tile (`state_step`). The B / C windows are read by every program of the group
and must be shifted only after all have read them: each program counts its arrival on the (row,
group) counter after its reads (acq_rel, GPU scope, after a barrier of its threads), and the one
that arrives last shifts them and sets the counter back to 0 (the counters of the few-rows
linear, `gemv.column_counters`, zero between launches on the one stream). A negative slot skips
the row: no pool access, no arrival, y zero. Launch parameters: the state update's
(`selective_state_update.launch_plan`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton._common import await_previous, pdl_launch
from mambaserve.ops.triton.conv1d_update import shift_window, window_conv
from mambaserve.ops.triton.gemv import MAX_COLUMN_BLOCKS, column_counters
from mambaserve.ops.triton.selective_state_update import (
    launch_plan,
    program_tile,
    state_step,
)


@triton.jit
def _conv_state_step_kernel(
    xbc_ptr, cw_ptr, cb_ptr, conv_ptr, ssm_ptr, dt_ptr, A_ptr, D_ptr, dt_bias_ptr, slot_ptr,
    y_ptr, cnt_ptr, dt_lo, dt_hi, P, N, G, heads_per_group, d_inner, arrivals,
    xbc_b, xbc_d, cw_d, cw_k, c_slot, c_k, c_d, s_slot, s_h, s_p, s_n, dt_b, dt_h, y_b, y_h,
    y_p, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    row, h, g, slot, valid, offs_p, offs_n = program_tile(slot_ptr, heads_per_group, BLOCK_P,
                                                          BLOCK_N)
    mp_all = offs_p < P
    mn_all = offs_n < N
    mp, mn = mp_all & valid, mn_all & valid
    x_row = xbc_ptr + row * xbc_b
    win = conv_ptr + slot * c_slot
    # the state tile first: its HBM read overlaps the conv work and the arrival below
    s_ptrs = ssm_ptr + slot * s_slot + h * s_h + offs_p[:, None] * s_p + offs_n[None, :] * s_n
    m2 = mp[:, None] & mn[None, :]
    state = tl.load(s_ptrs, mask=m2, other=0.0)

    # this program's x channels: conv, rounded as the conv launch stores it; own windows shifted
    ch_x = h * P + offs_p
    x_in = tl.load(x_row + ch_x * xbc_d, mask=mp_all, other=0.0)
    x = window_conv(x_in, cw_ptr, cb_ptr, win + ch_x * c_d, ch_x, mp_all, mp, cw_d, cw_k, c_k, K,
                    HAS_BIAS, True)
    x = x.to(x_in.dtype).to(tl.float32)
    shift_window(win + ch_x * c_d, x_in, mp, c_k, K)
    # the group's B and C channels, from the windows as they were before this step
    ch_b = d_inner + g * N + offs_n
    ch_c = ch_b + G * N
    b_in = tl.load(x_row + ch_b * xbc_d, mask=mn_all, other=0.0)
    c_in = tl.load(x_row + ch_c * xbc_d, mask=mn_all, other=0.0)
    Bv = window_conv(b_in, cw_ptr, cb_ptr, win + ch_b * c_d, ch_b, mn_all, mn, cw_d, cw_k, c_k,
                     K, HAS_BIAS, True).to(b_in.dtype).to(tl.float32)
    Cv = window_conv(c_in, cw_ptr, cb_ptr, win + ch_c * c_d, ch_c, mn_all, mn, cw_d, cw_k, c_k,
                     K, HAS_BIAS, True).to(c_in.dtype).to(tl.float32)
    if valid:
        tl.debug_barrier()  # every thread's window reads done before the arrival is counted
        arrived = tl.atomic_add(cnt_ptr + row * G + g, 1, sem="acq_rel", scope="gpu")
        if arrived == arrivals - 1:  # the group's last reader: shift its B / C windows
            shift_window(win + ch_b * c_d, b_in, mn, c_k, K)
            shift_window(win + ch_c * c_d, c_in, mn, c_k, K)
            tl.atomic_xchg(cnt_ptr + row * G + g, 0, sem="relaxed", scope="gpu")

    dt_raw = tl.load(dt_ptr + row * dt_b + h * dt_h).to(tl.float32)
    y = state_step(state, s_ptrs, m2, x, Bv, Cv, dt_raw, A_ptr, D_ptr, dt_bias_ptr, h, dt_lo,
                   dt_hi)
    y = tl.where(valid, y, 0.0)
    tl.store(y_ptr + row * y_b + h * y_h + offs_p * y_p, y.to(y_ptr.dtype.element_ty),
             mask=mp_all)


def conv_state_step_triton(xBC, conv_weight, conv_bias, conv_state, ssm_state, dt, A, D,
                           dt_bias, dt_limit, state_slots, n_groups):
    """Same contract as `mambaserve.ops.mamba_decode_step.conv_state_step`."""
    Bt, conv_dim = xBC.shape
    _, H, P, N = ssm_state.shape
    G = n_groups
    d_inner = H * P
    assert conv_dim == d_inner + 2 * G * N, (xBC.shape, ssm_state.shape, G)
    assert conv_weight.shape[0] == conv_dim and conv_state.shape[2] == conv_dim
    K = conv_weight.shape[1]
    assert conv_state.shape[1] == K - 1 and K >= 2, (conv_state.shape, K)
    assert dt.shape == (Bt, H) and H % G == 0 and state_slots.shape == (Bt,)
    assert A.is_contiguous() and D.is_contiguous() and dt_bias.is_contiguous()
    assert state_slots.is_contiguous()
    assert conv_bias is None or conv_bias.is_contiguous()
    y = torch.empty((Bt, H, P), dtype=xBC.dtype, device=xBC.device)
    if Bt == 0:
        return y
    assert Bt * G <= MAX_COLUMN_BLOCKS, f"{Bt} rows x {G} groups > {MAX_COLUMN_BLOCKS} counters"
    BLOCK_N = triton.next_power_of_2(N)
    block_p, num_warps = launch_plan(P, N, xBC.device)
    p_blocks = triton.cdiv(P, block_p)
    _conv_state_step_kernel[(Bt, H, p_blocks)](
        xBC, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state,
        ssm_state, dt, A, D, dt_bias, state_slots, y, column_counters(xBC.device),
        float(dt_limit[0]), float(dt_limit[1]), P, N, G, H // G, d_inner, (H // G) * p_blocks,
        *xBC.stride(), *conv_weight.stride(), *conv_state.stride(), *ssm_state.stride(),
        *dt.stride(), *y.stride(), K=K, HAS_BIAS=conv_bias is not None, BLOCK_P=block_p,
        BLOCK_N=BLOCK_N, num_warps=num_warps, **pdl_launch(xBC.device, _conv_state_step_kernel))
    return y
