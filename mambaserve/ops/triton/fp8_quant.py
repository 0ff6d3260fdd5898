"""Triton FP8 activation quantization: each row of x [M, K] scaled to float8_e4m3fn in one
launch, with its scale written on the device (no host sync). Dynamic: scale = max(amax(|row|),
1e-12) / 448, computed in the kernel; static: the one given scale for every row. Each element is
x / scale (IEEE division, `div_rn`, as torch divides), clamped to +-448, rounded to nearest even
by the cast: the same bits as the torch reference (`mambaserve.ops.fp8_matmul.quantize_fp8_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_FP8_MAX = tl.constexpr(448.0)
_MIN_AMAX = tl.constexpr(1e-12)
_BLOCK = 1024


@triton.jit(do_not_specialize=["K", "stride_x"])
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, in_scale_ptr, K, stride_x,
                       STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(in_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), _MIN_AMAX), _FP8_MAX)
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        m = offs < K
        v = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.math.div_rn(v, scale)
        q = tl.minimum(tl.maximum(q, -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=m)


def quantize_fp8_triton(x: torch.Tensor, input_scale: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided, last dim contiguous) -> (xq [M, K] float8_e4m3fn
    row-major, scale [M, 1] float32); `input_scale` a one-element float32 tensor (static) or
    None (dynamic per row)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "quantize_fp8_triton takes [M, K] rows"
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        static = input_scale is not None
        _quant_rows_kernel[(M,)](x, q, s, input_scale if static else s, K, x.stride(0),
                                 STATIC=static, BLOCK=_BLOCK, num_warps=4)
    return q, s
