"""Scaling a loaded layer's weights in place: how the families' multipliers are folded into the
projections they scale (`fold_scales` of the mixer, attention, MLP and MoE layers; the model's
`fold_multipliers`), once, at load time, so the forward has no separate multiply for them.

Every scale is applied in float32 (the factors computed in float64 first, then rounded once to
float32) and the weight is cast back to its dtype once: a bf16 weight differs from an exact
w * m by one rounding. An FP8 projection (`Fp8Linear`) keeps its FP8 weight and takes the scale
in its float32 per-row `weight_scale` instead; a scale of its input also divides its static
`input_scale`, so the activation it quantizes lands on the same FP8 grid as before.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.layers.fp8_linear import Fp8Linear

Scale = float | torch.Tensor  # a number, or float64 values along a tensor's first dimension


def is_one(scale: Scale) -> bool:
    return bool((torch.as_tensor(scale) == 1.0).all())


def scale_(t: torch.Tensor, scale: Scale) -> None:
    """t *= scale in place, in float32 with one cast back to t's dtype; a tensor `scale` scales
    t's rows (its first dimension)."""
    if is_one(scale):
        return
    factor = torch.as_tensor(scale, dtype=torch.float64).to(torch.float32).to(t.device)
    if factor.ndim:
        factor = factor.reshape(-1, *([1] * (t.ndim - 1)))
    t.copy_((t.float() * factor).to(t.dtype))


@torch.no_grad()
def scale_linear_(linear: nn.Module, out_scale: Scale = 1.0, in_scale: float = 1.0) -> None:
    """Make `linear(x)` compute what `linear(x * in_scale) * out_scale` did: the weight's rows
    times out_scale * in_scale, the bias times out_scale (`out_scale` a number or one value per
    output row)."""
    out = torch.as_tensor(out_scale, dtype=torch.float64)
    if isinstance(linear, Fp8Linear):
        scale_(linear.weight_scale, out * in_scale if out.ndim else out.item() * in_scale)
        if linear.input_scale is not None and in_scale != 1.0:
            linear.input_scale.copy_(linear.input_scale / torch.tensor(in_scale).float())
    elif isinstance(linear, nn.Linear):
        scale_(linear.weight, out * in_scale if out.ndim else out.item() * in_scale)
    else:
        raise TypeError(f"cannot fold a scale into a {type(linear).__name__}: an nn.Linear or "
                        "an Fp8Linear is expected (fold before sharding)")
    if linear.bias is not None:
        scale_(linear.bias, out if out.ndim else out.item())
