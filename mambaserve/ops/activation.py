"""relu² (squared ReLU), the activation of NemotronH's MLP layers and experts.

torch computes it as two passes over the [tokens, intermediate] activation (relu, then square);
on CUDA one Triton pass does both. The result is bit-identical: relu is exact, and the square is
taken in float32 and rounded once to the input dtype, as torch's half-precision square does.
"""

from __future__ import annotations

import torch

from mambaserve.ops.dispatch import kernel_path


def relu2(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0)² elementwise; any shape (a contiguous copy of x's layout is returned)."""
    if kernel_path("relu2", x.device, x=x) == "triton":
        from mambaserve.ops.triton.activation import relu2_triton

        return relu2_triton(x)
    return relu2_ref(x)


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()
