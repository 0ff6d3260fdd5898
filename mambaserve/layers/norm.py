"""RMSNorm as NemotronH computes it: float32 statistics and weight multiply, cast back after.
The math lives in `mambaserve.ops.rmsnorm` (one Triton pass on CUDA, the torch reference
elsewhere); `forward(x, residual)` also folds the residual add before the norm into that pass."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                quantize: bool = False):
        """RMSNorm(x); with `residual`: s = residual + x and (RMSNorm(s), s). `quantize`: the
        normalized rows as `Fp8Rows` (for an FP8 projection of dynamic scales)."""
        return rms_norm(x, self.weight, self.eps, residual, quantize)
