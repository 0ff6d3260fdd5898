"""Non-gated MLP with squared-ReLU activation (NemotronH's `mlp` layers and shared experts)."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.ops.activation import relu2  # one Triton pass on CUDA


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))
