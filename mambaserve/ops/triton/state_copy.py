"""Triton copy of rows between tensors for the prefix cache's restores (`restore_snapshots`:
a hit's snapshot into the live slot, over the pools' (layer, slot) rows, with no temporary).
Only the rows that have a destination move any bytes: a program whose row has no destination
(-1) returns after two index loads. (Snapshots need no copy: the prefill scan and, for decode
rows, the conv step and the state update write them.) Launch parameters: `tuning` entry
"state_copy".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, num_idx, layer_rows,
                      row_numel, src_stride, dst_stride, BLOCK: tl.constexpr):
    e = tl.program_id(0)  # (layer, index entry)
    layer = e // num_idx
    r = e - layer * num_idx
    dst = tl.load(dst_idx_ptr + r).to(tl.int64)
    src = tl.load(src_idx_ptr + r).to(tl.int64)
    if (dst >= 0) & (src >= 0):
        base = layer.to(tl.int64) * layer_rows
        dst += base
        src += base
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < row_numel
        v = tl.load(src_ptr + src * src_stride + offs, mask=m)
        tl.store(dst_ptr + dst * dst_stride + offs, v.to(dst_ptr.dtype.element_ty), mask=m)


def copy_rows_triton(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                     dst_idx: torch.Tensor, layers: int = 1, layer_rows: int = 0) -> None:
    """dst[l * layer_rows + dst_idx[r]] = src[l * layer_rows + src_idx[r]] (cast to dst's
    dtype) for every layer l < `layers` and every r with both indices >= 0, in place (one
    layer, the default: dst[dst_idx[r]] = src[src_idx[r]]). src: [n, ...], dst: [m, ...], rows
    of the same number of elements, each row contiguous (any row stride); src_idx, dst_idx: [R]
    integer tensors on their device. `layers` > 1 walks a pool [layers, layer_rows, ...] viewed
    as rows (restores: the same slots in every layer, no index arithmetic of its own). No
    destination may be read as another row's source (rows are copied concurrently)."""
    assert src[0].is_contiguous() and dst[0].is_contiguous(), "each row must be contiguous"
    assert src[0].numel() == dst[0].numel(), (src.shape, dst.shape)
    assert src_idx.shape == dst_idx.shape and src_idx.dim() == 1, (src_idx.shape, dst_idx.shape)
    assert src_idx.is_contiguous() and dst_idx.is_contiguous()
    cfg = tuning.config("state_copy", dst.device)
    block, num_warps = cfg["block"], cfg["num_warps"]
    assert block >= 16 and block & (block - 1) == 0, f"block must be a power of two, got {block}"
    assert layers == 1 or (layers * layer_rows <= min(src.shape[0], dst.shape[0])), \
        (layers, layer_rows, src.shape, dst.shape)
    R = src_idx.shape[0]
    row_numel = dst[0].numel()
    if R == 0 or row_numel == 0 or layers == 0:
        return
    _copy_rows_kernel[(layers * R, triton.cdiv(row_numel, block))](
        src, dst, src_idx, dst_idx, R, layer_rows, row_numel, src.stride(0), dst.stride(0),
        BLOCK=block, num_warps=num_warps,
    )
