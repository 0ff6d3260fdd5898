"""The linear product of every dense projection: y = x W^T (+ bias), `F.linear`'s contract.

    linear(x, weight, bias=None) -> [..., N] in x.dtype

Few token rows (decode: at most tuning "gemv" max_m rows) of a bfloat16 / float16 model on CUDA
run the Triton kernel of `ops/triton/gemv.py`, which reads the weight once at the copy ceiling
where cuBLAS's GEMV kernels do not (docs/kernels.md, "Few-rows linear"); everything else is
`torch.nn.functional.linear` (cuBLAS on a GPU), which is also the reference the kernel is tested
against. No path syncs or branches on tensor values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.dispatch import kernel_path


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    if kernel_path("gemv", x.device, x=x, weight=weight) == "triton":
        from mambaserve.ops.triton.gemv import gemv_triton

        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        return gemv_triton(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
