"""The MLP activations.

relu² (squared ReLU), of NemotronH's MLP layers and experts: torch computes it as two passes over
the [tokens, intermediate] activation (relu, then square); on CUDA one Triton pass does both. The
result is bit-identical: relu is exact, and the square is taken in float32 and rounded once to
the input dtype, as torch's half-precision square does.

silu_mul, SwiGLU's silu(gate) * up over the stacked [tokens, 2 x intermediate] output of the
gate / up projection (gate first): torch runs two passes (silu, then the product) and a
temporary; on CUDA one Triton pass reads gate and up once and writes the product. Both roundings
of the torch expression are kept (silu rounded to the dtype, then the product); the kernel's exp
is the GPU's fast float32 exp, so an element may differ from torch's by one ulp of the dtype.
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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 I] (gate = the first I columns, up = the last I) -> silu(gate) * up
    [..., I] in gate_up's dtype."""
    if kernel_path("silu_mul", gate_up.device, gate_up=gate_up) == "triton":
        from mambaserve.ops.triton.activation import silu_mul_triton

        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up
