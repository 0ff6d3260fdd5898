"""Triton kernels of the Mamba2 mixer's output gate: the grouped gated RMSNorm in its three
variants, and the gate without a norm.

`_gated_rmsnorm_kernel`, grid (tokens, groups): one program normalizes one group of `group_size`
channels of one token in float32 (BLOCK = next power of two >= group_size, masked), exactly as
`mambaserve.ops.gated_rmsnorm.gated_rmsnorm_ref` orders the roundings:
- gate first, weight after the cast (default): h = y·silu(z), normalized, cast to y.dtype, then
  multiplied by the weight in the dtype torch would promote the two to;
- gate first, weight in float32 (WEIGHT_FP32, Falcon-H1): h = y·silu(z), normalized, times the
  weight in float32, one cast to y.dtype;
- norm first (NORM_BEFORE_GATE, Falcon-H1; weight always in float32): y normalized, times the
  weight, times silu(z), all in float32, one cast to y.dtype.

`_gated_rmsnorm_fp8_kernel`, grid (tokens,): the same math on one token's whole row (a [groups,
BLOCK] tile, both padded to powers of two, at most `MAX_FP8_ROW_TILE` elements), the result
rounded to the output dtype and written as FP8 (e4m3 codes and the row's dynamic scale,
`fp8_quant.py`'s math): the input of an FP8 out_proj of dynamic scales, with no quantization
launch of its own.

`_gated_silu_kernel`, grid (tokens, blocks of BLOCK channels): y·silu(z) with silu rounded to
z.dtype first and the product in float32, one cast to y.dtype (Falcon-H1 without the norm).

Launch parameters: `tuning` entries "gated_rmsnorm" and "gated_silu".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch
from mambaserve.ops.triton.fp8_quant import e4m3_codes, row_scale

MAX_FP8_ROW_TILE = 16384  # [pow2(groups), pow2(group_size)] elements in registers


@triton.jit
def _gate_and_norm(y, z, w, group_size, eps, AXIS: tl.constexpr, CAST: tl.constexpr,
                   NORM_BEFORE_GATE: tl.constexpr, WEIGHT_FP32: tl.constexpr):
    """float32 tiles y, z, w whose axis AXIS runs over one group's channels (masked lanes 0) ->
    the float32 values before the one cast to the output dtype (CAST: y's dtype)."""
    gate = z / (1.0 + tl.exp(-z))
    h = y if NORM_BEFORE_GATE else y * gate
    var = tl.sum(h * h, axis=AXIS, keep_dims=True) / group_size
    h = h * (1.0 / tl.sqrt(var + eps))
    if NORM_BEFORE_GATE:
        h = h * w * gate
    elif WEIGHT_FP32:
        h = h * w
    else:  # cast first, then the weight multiply in the promoted dtype (the output's)
        h = h.to(CAST).to(tl.float32) * w
    return h


@triton.jit
def _gated_rmsnorm_kernel(
    y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps,
    y_t, y_d, z_t, z_d, o_t, o_d,
    BLOCK: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, WEIGHT_FP32: tl.constexpr,
    PDL: tl.constexpr,
):
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * group_size + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + t * y_t + offs * y_d, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = _gate_and_norm(y, z, w, group_size, eps, 0, y_ptr.dtype.element_ty, NORM_BEFORE_GATE,
                       WEIGHT_FP32)
    tl.store(out_ptr + t * o_t + offs * o_d, h.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gated_rmsnorm_fp8_kernel(
    y_ptr, z_ptr, w_ptr, q_ptr, s_ptr, groups, group_size, eps, y_t, y_d, z_t, z_d,
    GROUPS: tl.constexpr, BLOCK: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
    WEIGHT_FP32: tl.constexpr, OUT_DTYPE: tl.constexpr, HW_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    m = (g < groups) & (c < group_size)
    offs = g * group_size + c
    y = tl.load(y_ptr + t * y_t + offs * y_d, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    h = _gate_and_norm(y, z, w, group_size, eps, 1, y_ptr.dtype.element_ty, NORM_BEFORE_GATE,
                       WEIGHT_FP32)
    v = tl.where(m, h.to(OUT_DTYPE).to(tl.float32), 0.0)  # the rounded output's values
    scale = row_scale(tl.reshape(v, [GROUPS * BLOCK]))
    tl.store(s_ptr + t, scale)
    tl.store(q_ptr + t * groups * group_size + offs, e4m3_codes(v, scale, HW_FP8), mask=m)


@triton.jit
def _gated_silu_kernel(
    y_ptr, z_ptr, out_ptr, D,
    y_t, y_d, z_t, z_d, o_t, o_d,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < D
    y = tl.load(y_ptr + t * y_t + offs * y_d, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    gate = (z / (1.0 + tl.exp(-z))).to(z_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * o_t + offs * o_d, (y * gate).to(out_ptr.dtype.element_ty), mask=m)


def gated_rmsnorm_triton(y, z, weight, group_size, eps, norm_before_gate=False,
                         weight_fp32=False, out=None):
    """Same contract as `mambaserve.ops.gated_rmsnorm.gated_rmsnorm`."""
    T, Dm = y.shape
    assert z.shape == (T, Dm) and weight.shape == (Dm,), (y.shape, z.shape, weight.shape)
    assert Dm % group_size == 0, (Dm, group_size)
    assert weight.is_contiguous()
    weight_fp32 = weight_fp32 or norm_before_gate
    # the reference's `weight * h.to(y.dtype)`, or its one cast to y.dtype
    out_dtype = y.dtype if weight_fp32 else torch.result_type(weight, y)
    out = _output(out, (T, Dm), out_dtype, y.device)
    if T == 0:
        return out
    BLOCK = triton.next_power_of_2(group_size)
    num_warps = tuning.config("gated_rmsnorm", y.device)["num_warps"]
    if num_warps is None:
        num_warps = max(1, min(8, BLOCK // 256))
    grid = (T, Dm // group_size)
    _gated_rmsnorm_kernel[grid](
        y, z, weight, out, group_size, float(eps),
        *y.stride(), *z.stride(), *out.stride(), BLOCK=BLOCK,
        NORM_BEFORE_GATE=bool(norm_before_gate), WEIGHT_FP32=bool(weight_fp32),
        num_warps=num_warps, **pdl_launch(y.device, _gated_rmsnorm_kernel),
    )
    return out


def fp8_row_launch(rows: int, num_channels: int, group_size: int, device) -> bool:
    """Whether `gated_rmsnorm_fp8_triton` is the faster way to write these rows as FP8: they fit
    its tile and there are more than the tuning entry's `fp8_unfused_rows` of them (fewer take
    `gated_rmsnorm_triton`, then the quantization launch: at a few rows the whole-row launch is
    one SM's instruction issue per row, docs/kernels.md)."""
    return rows > tuning.config("gated_rmsnorm", device)["fp8_unfused_rows"] and \
        fits_fp8_row(num_channels, group_size)


def fits_fp8_row(num_channels: int, group_size: int) -> bool:
    """Whether `gated_rmsnorm_fp8_triton` holds a row of these groups in one tile."""
    groups = num_channels // group_size
    return triton.next_power_of_2(groups) * triton.next_power_of_2(group_size) <= \
        MAX_FP8_ROW_TILE


def gated_rmsnorm_fp8_triton(y, z, weight, group_size, eps, norm_before_gate=False,
                             weight_fp32=False):
    """`gated_rmsnorm_triton`'s result rounded to its output dtype, returned as (codes [T, D]
    float8_e4m3fn, scale [T, 1] float32) with dynamic per-row scales, for rows that
    `fits_fp8_row`; plus that output dtype."""
    T, Dm = y.shape
    assert z.shape == (T, Dm) and weight.shape == (Dm,), (y.shape, z.shape, weight.shape)
    assert Dm % group_size == 0 and fits_fp8_row(Dm, group_size), (Dm, group_size)
    assert weight.is_contiguous()
    weight_fp32 = weight_fp32 or norm_before_gate
    out_dtype = y.dtype if weight_fp32 else torch.result_type(weight, y)
    q = torch.empty((T, Dm), dtype=torch.float8_e4m3fn, device=y.device)
    s = torch.empty((T, 1), dtype=torch.float32, device=y.device)
    if T:
        groups = Dm // group_size
        GROUPS, BLOCK = triton.next_power_of_2(groups), triton.next_power_of_2(group_size)
        num_warps = tuning.config("gated_rmsnorm", y.device)["fp8_num_warps"]
        if num_warps is None:
            num_warps = min(32, max(4, GROUPS * BLOCK // 512))
        _gated_rmsnorm_fp8_kernel[(T,)](
            y, z, weight, q.view(torch.uint8), s, groups, group_size, float(eps), *y.stride(),
            *z.stride(), GROUPS=GROUPS, BLOCK=BLOCK, NORM_BEFORE_GATE=bool(norm_before_gate),
            WEIGHT_FP32=bool(weight_fp32), OUT_DTYPE=_TL_DTYPES[out_dtype],
            HW_FP8=y.device.type == "cuda" and not _INTERPRETED, num_warps=num_warps,
            **pdl_launch(y.device, _gated_rmsnorm_fp8_kernel))
    return q, s, out_dtype


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_INTERPRETED = isinstance(_gated_rmsnorm_fp8_kernel, InterpretedFunction)


def gated_silu_triton(y, z, out=None):
    """Same contract as `mambaserve.ops.gated_rmsnorm.gated_silu`."""
    T, Dm = y.shape
    assert z.shape == (T, Dm), (y.shape, z.shape)
    out = _output(out, (T, Dm), y.dtype, y.device)
    if T == 0:
        return out
    cfg = tuning.config("gated_silu", y.device)
    block = min(cfg["block"], triton.next_power_of_2(Dm))
    _gated_silu_kernel[(T, triton.cdiv(Dm, block))](
        y, z, out, Dm, *y.stride(), *z.stride(), *out.stride(), BLOCK=block,
        num_warps=cfg["num_warps"],
    )
    return out


def _output(out, shape, dtype, device):
    """`out` (any row stride, contiguous channels) checked, or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    assert out.shape == shape and out.dtype == dtype, (out.shape, out.dtype, shape, dtype)
    return out
