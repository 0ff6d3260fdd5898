"""The FP8 linear layer: an nn.Linear whose weight is stored as float8_e4m3fn with one float32
scale per output channel, its input quantized to FP8 on the fly (`ops/fp8_matmul.py`: cuBLASLt's
FP8 GEMM on CUDA >= 8.9, the exact quantize -> dequantize -> float32 matmul reference elsewhere).

Parameters (the names FP8 checkpoints use for a quantized `nn.Linear`):
    weight        [out, in]  float8_e4m3fn
    weight_scale  [out]      float32 (a checkpoint's per-tensor scale is stored in every row)
    input_scale   []         float32, only with a static activation scale (calibrated, per
                             tensor); without it each token row gets its own scale, max|x| / 448
    bias          [out]      model dtype, when the linear has one

An Fp8Linear of dynamic scales also takes its input already quantized (`Fp8Rows`, written by the
pass that produced the rows: the block's RMSNorm, the MLP activation); `takes_fp8_rows(module)`
says whether a block's first projection is one.

`swap_to_fp8(model, name)` replaces the module `name` (an nn.Linear) with an empty Fp8Linear of
the same shape (a checkpoint fills it); `Fp8Linear.from_linear` quantizes a loaded one (on-the-fly
FP8, per-channel weight scales, dynamic activation scales).
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.fp8_matmul import FP8_DTYPE, Fp8Rows, fp8_linear, quantize_weight_fp8


class Fp8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 static_input_scale: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32,
                                                    device=device), requires_grad=False)
        self.input_scale = nn.Parameter(torch.ones((), dtype=torch.float32, device=device),
                                        requires_grad=False) if static_input_scale else None
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype or torch.get_default_dtype(),
                                             device=device), requires_grad=False) if bias else None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """On-the-fly FP8 of a loaded linear: per-output-channel weight scales (max|row| / 448),
        dynamic per-token activation scales."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  static_input_scale=False, device=w.device, dtype=w.dtype)
        q, scale = quantize_weight_fp8(w, per_channel=True)
        out.weight.copy_(q)
        out.weight_scale.copy_(scale)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)

    def extra_repr(self) -> str:
        act = "static" if self.input_scale is not None else "dynamic per-token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation scale {act}")


def is_dynamic_fp8(module: nn.Module | None) -> bool:
    """An Fp8Linear with dynamic per-token activation scales (it takes `Fp8Rows`)."""
    return isinstance(module, Fp8Linear) and module.input_scale is None


def takes_fp8_rows(module: nn.Module) -> bool:
    """Whether `module` (a mixer or FFN) takes its input as `Fp8Rows`: its own
    `takes_fp8_rows()` says so (its first projection is FP8 of dynamic scales)."""
    check = getattr(module, "takes_fp8_rows", None)
    return bool(check is not None and check())


def swap_to_fp8(model: nn.Module, name: str, static_input_scale: bool) -> Fp8Linear:
    """Replace the nn.Linear at dotted path `name` with an Fp8Linear of its shape on its device
    (weight and scales unfilled: the loader copies them from the checkpoint)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    linear = getattr(parent, attr)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{name} is a {type(linear).__name__}, not a linear projection: it "
                         "cannot hold FP8 weights")
    w = linear.weight
    fp8 = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                    static_input_scale, device=w.device, dtype=w.dtype)
    setattr(parent, attr, fp8)
    return fp8


def quantize_linear_(model: nn.Module, name: str) -> Fp8Linear:
    """Replace the loaded nn.Linear at `name` with its on-the-fly FP8 quantization."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    fp8 = Fp8Linear.from_linear(getattr(parent, attr))
    setattr(parent, attr, fp8)
    return fp8
