"""RMSNorm of the decoder blocks, optionally fused with the residual add before it.

`rms_norm(x, weight, eps)` is NemotronH's RMSNorm (`mambaserve.layers.norm.RMSNorm`): float32
statistics and weight multiply, one cast back to x.dtype at the end.

`rms_norm(x, weight, eps, residual)` first forms the residual stream s = residual + x (rounded to
x.dtype, as torch's add does) and normalizes s; it returns (RMSNorm(s), s). A block's
`h = h + mixer_out; x = norm(h)` becomes one pass that reads h and mixer_out once and writes both
the new residual stream and the normalized input of the next mixer.

A float32 `residual` beside a lower-precision x (a residual stream kept in float32, Mamba2's
`residual_in_fp32`) gives s = residual + x in float32 (returned so), and the norm reads s rounded
to x.dtype: what `norm((residual + x).to(x.dtype))` computes, in one pass.

`quantize=True` returns the normalized rows as `Fp8Rows` (ops/fp8_matmul.py: e4m3 codes and
dynamic per-row scales, `quantize_fp8` of the rounded output) for an FP8 projection with dynamic
activation scales: the norm's pass writes them, and the projection quantizes nothing.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.fp8_matmul import Fp8Rows, quantize_rows


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, quantize: bool = False):
    """x: [T, D] (rows may be strided); weight: [D]; residual: None, or [T, D] in x.dtype or
    float32.

    Returns out [T, D] in x.dtype (`quantize`: as `Fp8Rows`), or (out, s) with s = residual + x
    (in residual's dtype) when residual is given; out normalizes s rounded to x.dtype.
    """
    fused = quantize and kernel_path("fp8_quant", x.device) == "triton"
    if kernel_path("rms_norm", x.device) == "triton":
        from mambaserve.ops.triton.rmsnorm import rms_norm_triton

        res = rms_norm_triton(x, weight, eps, residual, fused)
    else:
        res = rms_norm_ref(x, weight, eps, residual)
    if not quantize:
        return res
    out, s = res if residual is not None else (res, None)
    # the kernel's FP8 output, or the normalized rows quantized as `fp8_linear` would
    rows = Fp8Rows(*out, x.dtype) if fused else quantize_rows(out)
    return rows if residual is None else (rows, s)


def rms_norm_ref(x, weight, eps, residual=None):
    # The float math is `RMSNorm.forward` verbatim, so the fused op can replace the module
    # bit-for-bit on the reference path.
    s = x if residual is None else residual + x
    h = s.to(x.dtype).float()  # a float32 residual stream: the norm reads it rounded to x.dtype
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight.float() * h).to(x.dtype)
    return out if residual is None else (out, s)
