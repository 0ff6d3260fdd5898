"""`Linear`: `nn.Linear` (same parameters, state-dict names and init) whose forward runs
`mambaserve.ops.linear.linear`, so decode-sized products of a 16-bit model on CUDA take the
few-rows Triton kernel and everything else cuBLAS. Every dense projection of the models is one
(`is_plain_linear` tells them from the FP8 and tensor-parallel layers that replace some)."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.linear import linear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def is_plain_linear(module: nn.Module) -> bool:
    """A dense, unquantized, unsharded projection: an nn.Linear or a `Linear`, no subclass else."""
    return type(module) in (nn.Linear, Linear)
