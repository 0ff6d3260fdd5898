"""FP8 (e4m3) linear layer math: y = x W^T with W stored as float8_e4m3fn and one float32 scale
per output channel, x quantized to float8_e4m3fn on the fly.

    fp8_linear(x, weight, weight_scale, input_scale=None, bias=None) -> [..., N] in x.dtype

weight: [N, K] float8_e4m3fn; weight_scale: [N] float32 (a per-tensor scale is stored expanded
to every row, which is the same number); input_scale: a one-element float32 tensor (static
per-tensor activation scale, from a calibrated checkpoint) or None (dynamic: one scale per token
row, max|row| / 448, computed on the device). Activation quantization is q = clamp(x / s, -448,
448) rounded to nearest even by the cast; the dequantized product is
(q_x * s_x) (q_w * s_w)^T, accumulated in float32, rounded once to x.dtype, plus the bias.

Three implementations, picked by `ops.dispatch.kernel_path("fp8_gemv" / "fp8_linear", ...)`:

- few token rows (CUDA >= 8.9, bfloat16 x, at most tuning "fp8_gemv" max_m rows, unless
  switched off with MAMBASERVE_FP8_GEMV=0): the rows quantized by one launch
  (`ops/triton/fp8_quant.py`; with a static scale inside the kernel instead), then the Triton
  kernel of `ops/triton/fp8_gemv.py`, bandwidth-bound on the weight;
- the fast path (CUDA, compute capability >= 8.9, bfloat16 x, K and N multiples of 16): the
  activation is quantized by one Triton launch (`ops/triton/fp8_quant.py`, scales written on the
  device) and the product runs in cuBLASLt through `torch._scaled_mm` with row-wise scales
  (scale_a [M, 1], scale_b [1, N], bf16 out);
- the reference (`fp8_linear_ref`, everywhere else: CPU, older GPUs, float32 / float16 models):
  the same quantization in torch ops, both operands dequantized to float32, one float32 matmul.
  It computes the quantized model exactly as defined, only without FP8 tensor cores.

No path syncs or branches on tensor values, so all run inside CUDA graphs.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12  # a zero row gets scale 1e-12 / 448, not 0 (no division by zero)


def quantize_fp8_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32). Dynamic per row when
    `input_scale` is None, else the given one-element scale for every row."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_ref`'s contract; one Triton launch where the FP8 path runs."""
    if kernel_path("fp8_quant", x.device) == "triton":
        from mambaserve.ops.triton.fp8_quant import quantize_fp8_triton

        return quantize_fp8_triton(x if x.stride(-1) == 1 else x.contiguous(), input_scale)
    return quantize_fp8_ref(x, input_scale)


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale) with scale = max|w| / 448
    per output row ([N] float32) or over the whole tensor (a 0-d float32) when not
    `per_channel`. The weights of on-the-fly FP8 (`models/quantization.py`)."""
    wf = w.float()
    if per_channel:
        scale = wf.abs().amax(dim=1).clamp_min(MIN_AMAX) / FP8_MAX
        q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        scale = wf.abs().amax().clamp_min(MIN_AMAX) / FP8_MAX
        q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = dequant(quant(x)) dequant(weight)^T + bias in x.dtype (see the module docstring)."""
    if kernel_path("fp8_gemv", x.device, x=x, weight=weight) == "triton":
        return _fp8_linear_gemv(x, weight, weight_scale, input_scale, bias)
    if kernel_path("fp8_linear", x.device, x=x, weight=weight) == "triton":
        return _fp8_linear_scaled_mm(x, weight, weight_scale, input_scale, bias)
    return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)


def _fp8_linear_gemv(x, weight, weight_scale, input_scale, bias):
    """The few-rows kernel. With dynamic scales and tuning fp8_gemv.prequant, the rows are
    quantized first (`quantize_fp8`: one launch) and the kernel reads their e4m3 codes; else it
    quantizes them itself (each program recomputes the rows' amax over the whole K)."""
    from mambaserve.ops.triton.fp8_gemv import fp8_gemv_triton, prequantize

    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if input_scale is None and prequantize(x.device):
        q, s = quantize_fp8(x2)
        y = fp8_gemv_triton(q, weight, weight_scale, bias=bias, x_scale=s, out_dtype=x.dtype)
    else:
        y = fp8_gemv_triton(x2, weight, weight_scale, input_scale, bias)
    return y.reshape(*lead, weight.shape[0])


def _fp8_linear_scaled_mm(x, weight, weight_scale, input_scale, bias):
    from mambaserve.ops.triton.fp8_quant import quantize_fp8_triton

    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    q, s = quantize_fp8_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), input_scale)
    # weight [N, K] row-major: its transpose is the column-major [K, N] cuBLASLt wants
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, -1),
                         out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: quantize x as the fast path does, dequantize both operands, one float32
    matmul, the bias added in float32, one rounding to x.dtype."""
    lead, K = x.shape[:-1], x.shape[-1]
    q, s = quantize_fp8_ref(x.reshape(-1, K), input_scale)
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    y = (q.float() * s) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


__all__ = ["FP8_DTYPE", "FP8_MAX", "fp8_linear", "fp8_linear_ref",
           "quantize_fp8", "quantize_fp8_ref", "quantize_weight_fp8"]
