"""Triton prefill conv snapshots for the prefix cache: one launch per Mamba layer writes the K-1
xBC inputs before each snapshot position into the snapshot's destination slot.

Each snapshot entry s has K-1 indices `snap_conv_idx[s]` into the prefill "extended stream"
[P*(K-1) saved inputs of the P prefill rows | T new tokens] (`mambaserve.metadata`, part
"prefix-cache snapshots"). An index e < P*(K-1) is saved position e % (K-1) of row e // (K-1):
`conv_state[slot, e % (K-1)]` of that row's slot (the scratch slot, the pool's last, when the
slot is negative), or zero when the row has no initial state; a larger e is the new token
x[e - P*(K-1)]. Saved inputs pass through x's dtype before the cast to the pool's dtype, as the
reference does (which builds the stream in x's dtype), so the values written are the reference's
bit for bit.

The reference (`mambaserve.ops.state_snapshot.save_prefill_conv_snapshots_ref`) materializes the
whole extended stream (gather, where, cat over every prefill token), gathers the snapshot windows
and scatters them, about six launches per layer, and sends entries without a destination (-1,
the padding of a prefill CUDA graph's fixed snapshot count) to the scratch slot. Here a program
whose entry has no destination returns after one index load: it moves no bytes and leaves the
scratch slot alone (which holds nothing anyone reads).

Grid: (S entries, cdiv(conv_dim, BLOCK_D)). Destination slots are reserved snapshot slots, never
a prefill row's live slot, so no program reads what another one writes. Launch parameters:
`tuning` entry "conv_snapshot".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch


@triton.jit
def _conv_snapshot_kernel(
    x_ptr, state_ptr, slot_ptr, init_ptr, idx_ptr, dst_ptr,
    Dm, PK1, scratch,
    x_t, x_d, s_slot, s_k, s_d, i_s, i_k,
    K1: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    s = tl.program_id(0).to(tl.int64)
    dst = tl.load(dst_ptr + s).to(tl.int64)
    if dst >= 0:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        md = d < Dm
        out = state_ptr + dst * s_slot + d * s_d
        for k in tl.static_range(K1):
            e = tl.load(idx_ptr + s * i_s + k * i_k).to(tl.int64)
            saved = e < PK1
            # a saved input: row r's slot, position u (zero without an initial state)
            r = tl.where(saved, e // K1, 0)
            u = e - r * K1
            slot = tl.load(slot_ptr + r, mask=saved, other=0).to(tl.int64)
            slot = tl.where(slot < 0, scratch, slot)
            init = tl.load(init_ptr + r, mask=saved, other=0) != 0
            sv = tl.load(state_ptr + slot * s_slot + u * s_k + d * s_d,
                         mask=md & saved & init, other=0.0)
            sv = sv.to(x_ptr.dtype.element_ty).to(state_ptr.dtype.element_ty)
            # a new token
            t = tl.where(saved, 0, e - PK1)
            xv = tl.load(x_ptr + t * x_t + d * x_d, mask=md & (e >= PK1), other=0.0)
            v = tl.where(saved, sv, xv.to(state_ptr.dtype.element_ty))
            tl.store(out + k * s_k, v, mask=md)


def save_prefill_conv_snapshots_triton(x: torch.Tensor, conv_state: torch.Tensor,
                                       state_slots: torch.Tensor,
                                       has_initial_state: torch.Tensor,
                                       snap_conv_idx: torch.Tensor,
                                       snap_dst: torch.Tensor) -> None:
    """Same contract as `mambaserve.ops.state_snapshot.save_prefill_conv_snapshots`, except that
    entries with snap_dst < 0 write nothing (the reference writes them into the scratch slot).

    x: [T, conv_dim] xBC of the prefill rows (any strides: a column slice of the projection);
    conv_state: [num_slots + 1, K-1, conv_dim] (any strides; last slot = scratch);
    state_slots: [P] integer (negative = the scratch slot); has_initial_state: [P] bool;
    snap_conv_idx: [S, K-1] integer into the extended stream; snap_dst: [S] integer (-1: none).
    No destination may be a prefill row's slot (snapshot slots are reserved, never live)."""
    _, Dm = x.shape
    num_slots, K1, Ds = conv_state.shape
    P, S = state_slots.shape[0], snap_dst.shape[0]
    assert Ds == Dm, (x.shape, conv_state.shape)
    assert has_initial_state.shape == (P,), (has_initial_state.shape, P)
    assert snap_conv_idx.shape == (S, K1), (snap_conv_idx.shape, S, K1)
    assert snap_dst.dim() == 1 and state_slots.dim() == 1
    assert state_slots.is_contiguous() and has_initial_state.is_contiguous()
    assert snap_dst.is_contiguous()
    cfg = tuning.config("conv_snapshot", conv_state.device)
    block_d, num_warps = cfg["block_d"], cfg["num_warps"]
    assert block_d >= 16 and block_d & (block_d - 1) == 0, \
        f"block_d must be a power of two >= 16, got {block_d}"
    if S == 0 or K1 == 0 or Dm == 0:
        return
    grid = (S, triton.cdiv(Dm, block_d))
    _conv_snapshot_kernel[grid](
        x, conv_state, state_slots, has_initial_state, snap_conv_idx, snap_dst,
        Dm, P * K1, num_slots - 1,
        *x.stride(), *conv_state.stride(), *snap_conv_idx.stride(),
        K1=K1, BLOCK_D=block_d, num_warps=num_warps,
        **pdl_launch(conv_state.device, _conv_snapshot_kernel),
    )
