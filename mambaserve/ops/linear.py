"""The linear product of every dense projection: y = x W^T (+ bias), `F.linear`'s contract.

    linear(x, weight, bias=None) -> [..., N] in x.dtype

Few token rows (decode: at most tuning "gemv" max_m rows) of a bfloat16 / float16 model on CUDA
run the Triton kernel of `ops/triton/gemv.py`, which reads the weight once at the copy ceiling
where cuBLAS's GEMV kernels do not (docs/kernels.md, "Few-rows linear"); everything else is
`torch.nn.functional.linear` (cuBLAS on a GPU), which is also the reference the kernel is tested
against. No path syncs or branches on tensor values.

Two fused forms for the same few rows, each one launch of that kernel where two ran (elsewhere the
two public ops they stand for):

    rms_norm_linear(x, norm_weight, eps, weight, bias=None, residual=None)
        linear(rms_norm(x, norm_weight, eps[, residual]), weight, bias) -> y, or (y, s) with the
        residual stream s = residual + x: a decoder block's norm and the projection that reads
        it. The kernel does not round the normalized rows to the dtype before the product (the
        two-launch path does): results agree to the dtype's rounding, not bit for bit.
    gated_rmsnorm_linear(y, z, norm_weight, group_size, eps, norm_before_gate, weight, bias=None,
                         weight_fp32=False)
        linear(gated_rmsnorm(y, z, ...), weight, bias): the Mamba mixer's gated norm and its
        out_proj; likewise not rounded before the product (`weight_fp32` only matters there).
    act_linear(x, act, weight, bias=None)
        linear(act(x), weight, bias), act "relu2" or "silu_mul": an MLP's activation and its down
        projection; the kernel rounds the activation as `ops/activation.py` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.activation import relu2, silu_mul
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.gated_rmsnorm import gated_rmsnorm
from mambaserve.ops.rmsnorm import rms_norm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """`add` (the output's shape and dtype): linear(x, weight, bias) + add, the sum rounded as
    torch rounds it (the kernel adds it in its epilogue: no launch of its own)."""
    if kernel_path("gemv", x.device, x=x, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import gemv_triton

        N = weight.shape[0]
        y = gemv_triton(_rows(x), weight, bias, None if add is None else _rows(add.expand(
            *x.shape[:-1], N)))
        return y.view(*x.shape[:-1], N)
    y = F.linear(x, weight, bias)
    return y if add is None else y + add


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, K]; see the module docstring."""
    if kernel_path("rms_norm_linear", x.device, x=x, weight=weight,
                   residual=residual) == "triton":
        from mambaserve.ops.triton.gemv import rms_norm_gemv_triton

        return rms_norm_gemv_triton(_rows(x), norm_weight, eps, weight, bias,
                                    None if residual is None else _rows(residual))
    if residual is None:
        return linear(rms_norm(x, norm_weight, eps), weight, bias)
    normed, s = rms_norm(x, norm_weight, eps, residual)
    return linear(normed, weight, bias), s


def gated_rmsnorm_linear(y: torch.Tensor, z: torch.Tensor, norm_weight: torch.Tensor,
                         group_size: int, eps: float, norm_before_gate: bool,
                         weight: torch.Tensor, bias: torch.Tensor | None = None,
                         weight_fp32: bool = False) -> torch.Tensor:
    """y, z: [T, D]; see the module docstring."""
    if kernel_path("gated_rmsnorm_linear", y.device, x=y, weight=weight,
                   group_size=group_size) == "triton":
        from mambaserve.ops.triton.gemv import gated_norm_gemv_triton

        return gated_norm_gemv_triton(_rows(y), _rows(z), norm_weight, group_size, eps,
                                      norm_before_gate, weight, bias)
    return linear(gated_rmsnorm(y, z, norm_weight, group_size, eps, norm_before_gate,
                                weight_fp32), weight, bias)


_ACTIVATIONS = {"relu2": relu2, "silu_mul": silu_mul}


def act_linear(x: torch.Tensor, act: str, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] ([..., 2K] = [gate | up] for "silu_mul"); see the module docstring."""
    if act not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; known: {sorted(_ACTIVATIONS)}")
    if kernel_path("act_linear", x.device, x=x, act=act, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import act_gemv_triton

        return act_gemv_triton(_rows(x), act, weight, bias).view(*x.shape[:-1],
                                                                 weight.shape[0])
    return linear(_ACTIVATIONS[act](x), weight, bias)
