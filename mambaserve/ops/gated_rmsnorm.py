"""Grouped gated RMSNorm of the Mamba2 mixer: w * rmsnorm_per_group(y * silu(z))."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.dispatch import kernel_path


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                  eps: float) -> torch.Tensor:
    """y, z: [T, D]; weight: [D]; normalizes each group of `group_size` channels in float32.

    Returns [T, D] in y.dtype (the weight multiply happens after the cast, as transformers does).
    """
    if kernel_path("gated_rmsnorm", y.device) == "triton":
        from mambaserve.ops.triton.gated_rmsnorm import gated_rmsnorm_triton

        return gated_rmsnorm_triton(y, z, weight, group_size, eps)
    return gated_rmsnorm_ref(y, z, weight, group_size, eps)


def gated_rmsnorm_ref(y, z, weight, group_size, eps):
    T, Dm = y.shape
    h = y.float() * F.silu(z.float())
    h = h.view(T, Dm // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(T, Dm).to(y.dtype)
