"""Triton RMSNorm, optionally fused with the residual add: out = cast(w · rmsnorm(s)), s = r + x
(r in x's dtype, or float32: then s is float32 and normalized rounded to x's dtype).

Grid: (tokens,). One program holds one whole row in registers (BLOCK_D = next power of two >= D,
masked), so each input is read once and each output written once: with a residual it loads x
and r, stores s = cast(r + x) and normalizes the rounded s (what the reference normalizes); the
mean square, rsqrt and weight multiply are float32, with one cast to x.dtype at the end. A single
pass fits the hidden sizes in use (Nemotron-H: 4480 -> BLOCK_D 8192, 32 fp32 values per thread
and tensor at 8 warps); the launcher refuses rows wider than 32K.

`QUANT`: the normalized row, rounded to x's dtype, is written as FP8 instead (e4m3 codes through
a uint8 view and the row's dynamic scale, max(amax, 1e-12) / 448: `ops/triton/fp8_quant.py`'s
math on the values it holds), the input of an FP8 projection with no quantization pass of its
own. The code store's offsets carry a contiguity hint of one 16-byte load of x (8 codes per
thread for bf16): unhinted, Triton stores bytes 16 per thread, unlike the loads and the residual
store, and moves the whole row between the two layouts through shared memory.

The launcher reads no device value (shapes and strides only) and allocates with torch.empty, so
it can be captured in a CUDA graph. Launch parameters: `tuning` entry "rms_norm".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from mambaserve.ops.triton import tuning
from mambaserve.ops.triton._common import await_previous, pdl_launch
from mambaserve.ops.triton.fp8_quant import e4m3_codes, row_scale

# 64 fp32 values per thread and tensor at 16 warps; wider rows would need a looped two-pass kernel
_MAX_BLOCK_D = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, scale_ptr, D, eps,
    x_t, x_d, r_t, r_d, w_d, o_t, s_t,
    HAS_RESIDUAL: tl.constexpr, ADD_NATIVE: tl.constexpr, QUANT: tl.constexpr,
    HW_FP8: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    t = tl.program_id(0).to(tl.int64)  # row strides of wide strided views can pass 2^31 / T
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    xv = tl.load(x_ptr + t * x_t + offs * x_d, mask=m, other=0.0)
    if HAS_RESIDUAL:
        rv = tl.load(r_ptr + t * r_t + offs * r_d, mask=m, other=0.0)
        # The add as torch does it: half/bf16 in fp32 with one rounding to the dtype (bit-identical
        # to the reference's s), fp32 and fp64 natively. The rounded s is what gets normalized.
        if ADD_NATIVE:
            s = xv + rv
        else:
            s = (xv.to(tl.float32) + rv.to(tl.float32)).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + t * s_t + offs, s, mask=m)
        xv = s.to(x_ptr.dtype.element_ty)  # a float32 s (float32 residual) is normalized rounded
    h = xv.to(tl.float32)
    # masked lanes hold 0, so they add nothing to the sum of squares
    ms = tl.sum(h * h, axis=0) / D
    h = h * tl.rsqrt(ms + eps)
    w = tl.load(w_ptr + offs * w_d, mask=m, other=0.0).to(tl.float32)
    y = (w * h).to(x_ptr.dtype.element_ty)
    if QUANT:
        v = y.to(tl.float32)
        scale = row_scale(v)
        tl.store(scale_ptr + t, scale)
        q_offs = tl.max_contiguous(offs, 128 // x_ptr.dtype.element_ty.primitive_bitwidth)
        tl.store(out_ptr + t * o_t + q_offs, e4m3_codes(v, scale, HW_FP8), mask=m)
    else:
        tl.store(out_ptr + t * o_t + offs, y, mask=m)


def rms_norm_triton(x, weight, eps, residual=None, quantize=False):
    """Same contract as `mambaserve.ops.rmsnorm.rms_norm`; outputs are contiguous. `quantize`:
    out is (codes [T, D] float8_e4m3fn, scale [T, 1] float32) of the normalized rows."""
    assert x.dim() == 2, x.shape
    T, D = x.shape
    assert weight.shape == (D,), (x.shape, weight.shape)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype in (x.dtype, torch.float32), (
            x.shape, x.dtype, residual.shape, residual.dtype)
    out = torch.empty((T, D), dtype=torch.float8_e4m3fn if quantize else x.dtype,
                      device=x.device)
    scale = torch.empty((T, 1), dtype=torch.float32, device=x.device) if quantize else None
    res = (out, scale) if quantize else out
    s = None if residual is None else torch.empty((T, D), dtype=residual.dtype,
                                                  device=x.device)
    if T == 0 or D == 0:
        return res if s is None else (res, s)
    BLOCK_D = triton.next_power_of_2(D)
    assert BLOCK_D <= _MAX_BLOCK_D, f"rms_norm_triton: row of {D} too wide for one pass"
    num_warps = tuning.config("rms_norm", x.device)["num_warps"]
    if num_warps is None:
        # at most 16 values per thread and tensor up to 4096, 32 at 8192 (Nemotron-H's 4480),
        # then 16 warps; a guess, not swept
        num_warps = 16 if BLOCK_D >= 16384 else max(1, min(8, BLOCK_D // 512))
    # Without a residual the kernel never touches r/s, without QUANT the scale (constexprs): x
    # takes their place so every pointer argument is a real tensor.
    r, s_arg = (x, x) if residual is None else (residual, s)
    _rms_norm_kernel[(T,)](
        x, r, weight, out.view(torch.uint8) if quantize else out, s_arg,
        scale if quantize else x, D, float(eps),
        x.stride(0), x.stride(1), r.stride(0), r.stride(1), weight.stride(0),
        out.stride(0), s_arg.stride(0),
        HAS_RESIDUAL=residual is not None,
        ADD_NATIVE=x.dtype in (torch.float32, torch.float64) and (residual is None
                                                                  or residual.dtype == x.dtype),
        QUANT=quantize, HW_FP8=x.device.type == "cuda" and not _INTERPRETED,
        BLOCK_D=BLOCK_D, num_warps=num_warps, **pdl_launch(x.device, _rms_norm_kernel),
    )
    return res if s is None else (res, s)


_INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)
