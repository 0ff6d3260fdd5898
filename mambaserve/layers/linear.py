"""`Linear`: `nn.Linear` (same parameters, state-dict names and init) whose forward runs
`mambaserve.ops.linear.linear`, so decode-sized products of a 16-bit model on CUDA take the
few-rows Triton kernel and everything else cuBLAS. Every dense projection of the models is one
(`is_plain_linear` tells them from the FP8 and tensor-parallel layers that replace some);
`folds_residual` tells the block-closing projections that can add the residual stream in their
own epilogue (`ops.linear.linear_residual`)."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.linear import linear, linear_residual


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_plain_linear(module: nn.Module) -> bool:
    """A dense, unquantized, unsharded projection: an nn.Linear or a `Linear`, no subclass else."""
    return type(module) in (nn.Linear, Linear)


def folds_residual(module: nn.Module) -> bool:
    """A plain projection without bias: `residual_projection` can add the stream in its
    epilogue."""
    return is_plain_linear(module) and module.bias is None


def residual_projection(module: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + module(x) for a projection `folds_residual` accepts (`linear_residual`: in
    place on cuBLAS, `residual` is then the result)."""
    assert folds_residual(module), type(module).__name__
    return linear_residual(x, module.weight, residual)
