"""Triton grouped gated RMSNorm: out = w * cast(rmsnorm_group(y * silu(z)), y.dtype).

Grid: (tokens, groups). One program normalizes one group of `group_size` channels of one token in
float32 (BLOCK = next power of two >= group_size, masked), casts to y.dtype and multiplies by the
weight in the dtype torch would promote to, exactly as the reference does. Launch parameters:
`tuning` entry "gated_rmsnorm".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mambaserve.ops.triton import tuning


@triton.jit
def _gated_rmsnorm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps,
    y_t, y_d, z_t, z_d, o_t, o_d,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * group_size + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + t * y_t + offs * y_d, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    h = y * (z / (1.0 + tl.exp(-z)))
    var = tl.sum(h * h, axis=0) / group_size
    h = h * (1.0 / tl.sqrt(var + eps))
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * o_t + offs * o_d, (h * w).to(out_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm_triton(y, z, weight, group_size, eps):
    """Same contract as `mambaserve.ops.gated_rmsnorm.gated_rmsnorm`."""
    T, Dm = y.shape
    assert z.shape == (T, Dm) and weight.shape == (Dm,), (y.shape, z.shape, weight.shape)
    assert Dm % group_size == 0, (Dm, group_size)
    assert weight.is_contiguous()
    out_dtype = torch.result_type(weight, y)  # the reference's `weight * h.to(y.dtype)`
    out = torch.empty((T, Dm), dtype=out_dtype, device=y.device)
    if T == 0:
        return out
    BLOCK = triton.next_power_of_2(group_size)
    num_warps = tuning.config("gated_rmsnorm", y.device)["num_warps"]
    if num_warps is None:
        num_warps = max(1, min(8, BLOCK // 256))
    grid = (T, Dm // group_size)
    _gated_rmsnorm_kernel[grid](
        y, z, weight, out, group_size, float(eps),
        *y.stride(), *z.stride(), *out.stride(), BLOCK=BLOCK, num_warps=num_warps,
    )
    return out
