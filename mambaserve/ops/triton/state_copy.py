"""Triton copy of state-pool slots for the prefix cache's decode snapshots: only the rows that
have a destination move any bytes.

The reference (`mambaserve.ops.state_snapshot.save_decode_snapshots`) gathers every decode row's
state and scatters it to the row's destination, sending rows without one (-1) to the scratch slot.
Inside a CUDA graph the shapes are fixed (one destination per decode row, nearly all -1, since a
row snapshots once per snapshot interval), so that path moves every row's whole state per layer
and step: at the Nemotron-Nano-9B-v2 shapes 5.2 MB of fp32 SSM state per row, read and written
twice. Here a program whose row has no destination returns after two index loads. Launch
parameters: `tuning` entry "state_copy".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning


@triton.jit
def _copy_slots_kernel(pool_ptr, src_ptr, dst_ptr, slot_numel, slot_stride,
                       BLOCK: tl.constexpr):
    r = tl.program_id(0)
    dst = tl.load(dst_ptr + r).to(tl.int64)
    src = tl.load(src_ptr + r).to(tl.int64)
    if (dst >= 0) & (src >= 0):
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < slot_numel
        v = tl.load(pool_ptr + src * slot_stride + offs, mask=m)
        tl.store(pool_ptr + dst * slot_stride + offs, v, mask=m)


def copy_state_slots_triton(pool: torch.Tensor, src_slots: torch.Tensor,
                            dst_slots: torch.Tensor) -> None:
    """pool[dst_slots[r]] = pool[src_slots[r]] for every r with both slots >= 0, in place.

    pool: [num_slots, ...], each slot contiguous (any slot stride); src_slots, dst_slots: [R]
    integer tensors on pool's device. No destination may be another row's source (snapshot slots
    are reserved, never live), since rows are copied concurrently.
    """
    assert pool[0].is_contiguous(), "each slot of the pool must be contiguous"
    assert src_slots.shape == dst_slots.shape and src_slots.dim() == 1, (src_slots.shape,
                                                                           dst_slots.shape)
    assert src_slots.is_contiguous() and dst_slots.is_contiguous()
    cfg = tuning.config("state_copy", pool.device)
    block, num_warps = cfg["block"], cfg["num_warps"]
    assert block >= 16 and block & (block - 1) == 0, f"block must be a power of two, got {block}"
    R = src_slots.shape[0]
    slot_numel = pool[0].numel()
    if R == 0 or slot_numel == 0:
        return
    _copy_slots_kernel[(R, triton.cdiv(slot_numel, block))](
        pool, src_slots, dst_slots, slot_numel, pool.stride(0), BLOCK=block, num_warps=num_warps,
    )
