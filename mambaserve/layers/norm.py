"""RMSNorm as NemotronH computes it: float32 statistics and weight multiply, cast back after.
The math lives in `mambaserve.ops.rmsnorm` (one Triton pass on CUDA, the torch reference
elsewhere); `forward(x, residual)` also folds the residual add before the norm into that pass;
`project(x, projection, residual)` also the projection that reads the normalized rows
(`ops.linear.rms_norm_linear`: one launch for decode-sized batches)."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.linear import rms_norm_linear
from mambaserve.ops.rmsnorm import rms_norm

# a projection's (weight [N, K], bias [N] or None): what a mixer's `input_projection` returns
Projection = tuple[torch.Tensor, torch.Tensor | None]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x); with `residual`: s = residual + x and (RMSNorm(s), s)."""
        return rms_norm(x, self.weight, self.eps, residual)

    def project(self, x: torch.Tensor, projection: Projection,
                residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """linear(self(x[, residual]), *projection) [, s]: the same contract as `forward` with
        the normalized rows projected."""
        weight, bias = projection
        return rms_norm_linear(x, self.weight, self.eps, weight, bias, residual)
