"""FP8 (e4m3) linear layer math: y = x W^T with W stored as float8_e4m3fn and one float32 scale
per output channel, x quantized to float8_e4m3fn on the fly.

    fp8_linear(x, weight, weight_scale, input_scale=None, bias=None) -> [..., N] in x.dtype

weight: [N, K] float8_e4m3fn; weight_scale: [N] float32 (a per-tensor scale is stored expanded
to every row, which is the same number); input_scale: a one-element float32 tensor (static
per-tensor activation scale, from a calibrated checkpoint) or None (dynamic: one scale per token
row, max|row| / 448, computed on the device). Activation quantization is q = clamp(x * (1 / s),
-448, 448) rounded to nearest even by the cast (1 / s rounded to float32 once per row, then one
multiplication per element, as fast quantization kernels do; every implementation computes
these very bits); the dequantized product is
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

x may also be given already quantized, as `Fp8Rows` (codes, per-row scales, the dtype of the rows
they stand for): what the kernel that produced the rows wrote in the same pass (the decoder
block's RMSNorm, `ops/rmsnorm.py`; the MLP activation, `quantize_fp8(..., act=)`), so no
quantization pass runs before the product. Every path then skips its own quantization; the
result is the one of quantizing inside (the same codes and scales).

No path syncs or branches on tensor values, so all run inside CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mambaserve.ops.dispatch import kernel_path

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-12  # a zero row gets scale 1e-12 / 448, not 0 (no division by zero)


class Fp8Rows(NamedTuple):
    """Token rows quantized with dynamic per-row scales: codes q [T, K] float8_e4m3fn
    (row-major), scale [T, 1] float32, and `dtype`, the dtype of the rows they stand for (the
    product's output dtype). Shape, dtype and device answer as those rows' would."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device


def quantize_fp8_ref(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                     act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32). Dynamic per row when
    `input_scale` is None, else the given one-element scale for every row. `act` "relu2" /
    "silu_mul" (x [M, 2K]): the rows quantized are those of that activation of x
    (`ops/activation.py`, rounded to x.dtype)."""
    if act is not None:
        from mambaserve.ops.activation import relu2_ref, silu_mul_ref

        x = relu2_ref(x) if act == "relu2" else silu_mul_ref(x)
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_AMAX)
        # a division by a tensor: IEEE on every device (CUDA divides by a Python number as a
        # multiplication by its reciprocal, one ulp away at times)
        scale = amax / torch.full_like(amax, FP8_MAX)
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    q = (xf * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                 act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_ref`'s contract; one Triton launch (the activation included) where the
    FP8 path runs."""
    if kernel_path("fp8_quant", x.device) == "triton":
        from mambaserve.ops.triton.fp8_quant import quantize_fp8_triton

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        q, s = quantize_fp8_triton(x2 if x2.stride(-1) == 1 else x2.contiguous(), input_scale,
                                   act)
        return q.reshape(*lead, q.shape[-1]), s
    return quantize_fp8_ref(x, input_scale, act)


def quantize_rows(x: torch.Tensor, act: str | None = None) -> Fp8Rows:
    """act(x) [T, K] (the activation rounded to x.dtype) as `Fp8Rows` with dynamic scales, for
    an `fp8_linear` of dynamic activation scales; one launch on the FP8 path."""
    q, s = quantize_fp8(x, None, act)
    return Fp8Rows(q, s, x.dtype)


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q [N, K] float8_e4m3fn, scale) with scale = max|w| / 448
    per output row ([N] float32) or over the whole tensor (a 0-d float32) when not
    `per_channel`. The weights of on-the-fly FP8 (`models/quantization.py`)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax()
    # divisions by tensors: IEEE on every device, so a checkpoint quantized on the CPU and the
    # same weights quantized on the GPU get the same scales and codes (CUDA divides by a Python
    # number as a multiplication by its reciprocal, one ulp away at times)
    amax = amax.clamp_min(MIN_AMAX)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (wf / (scale[:, None] if per_channel else scale)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = dequant(quant(x)) dequant(weight)^T + bias in x.dtype (see the module docstring).
    x as `Fp8Rows` (already quantized, dynamic scales) takes no `input_scale`."""
    if isinstance(x, Fp8Rows):
        assert input_scale is None, "rows quantized with dynamic scales take no input_scale"
        assert x.q.dim() == 2, "Fp8Rows hold [T, K] rows"
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

    if isinstance(x, Fp8Rows):
        return fp8_gemv_triton(x.q, weight, weight_scale, bias=bias, x_scale=x.scale,
                               out_dtype=x.dtype)
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
    if isinstance(x, Fp8Rows):
        lead, (q, s) = x.shape[:-1], (x.q, x.scale)
    else:
        lead = x.shape[:-1]
        q, s = quantize_fp8(x.reshape(-1, x.shape[-1]), input_scale)
    # weight [N, K] row-major: its transpose is the column-major [K, N] cuBLASLt wants
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, -1),
                         out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def fp8_linear_ref(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: quantize x as the fast path does, dequantize both operands, one float32
    matmul, the bias added in float32, one rounding to x.dtype."""
    if isinstance(x, Fp8Rows):
        lead, (q, s) = x.shape[:-1], (x.q, x.scale)
    else:
        lead = x.shape[:-1]
        q, s = quantize_fp8_ref(x.reshape(-1, x.shape[-1]), input_scale)
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    y = (q.float() * s) @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Rows", "fp8_linear", "fp8_linear_ref",
           "quantize_fp8", "quantize_fp8_ref", "quantize_rows", "quantize_weight_fp8"]
