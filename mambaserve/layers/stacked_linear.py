"""Several projections as one `Linear`, so a forward runs one GEMM (one weight read, one launch):
- `stacked_linear`: projections of the same input, their weights (and biases) stacked by rows;
  the forward splits the output by the parts' `out_features`;
- `summed_linear`: projections whose outputs are added, their weights side by side along the
  input dimension (biases summed); the forward's input is the parts' inputs side by side.
Used once the weights are final (loaded, folded, sharded): `Attention.pack_qkv` and
`DecoderLayer.pack_mixer_projections`."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.layers.linear import Linear, is_plain_linear


@torch.no_grad()
def stacked_linear(parts: list[nn.Module]) -> Linear | None:
    """One `Linear` whose rows are the parts' rows in order, or None when a part is not a
    plain linear (FP8) or only some have a bias. The parts' tensors are not kept."""
    if not all(is_plain_linear(p) for p in parts):
        return None
    if len({p.bias is None for p in parts}) > 1:
        return None
    w = torch.cat([p.weight for p in parts])
    out = Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=parts[0].weight.requires_grad)
    if parts[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([p.bias for p in parts]),
                                requires_grad=parts[0].bias.requires_grad)
    return out



@torch.no_grad()
def summed_linear(parts: list[nn.Module]) -> Linear | None:
    """One `Linear` computing sum_i part_i(x_i) from [x_0 | x_1 | ...] (columns side by side, in
    the parts' order), or None when a part is not a plain linear or only some have a bias. The
    biases add in float32 with one rounding. The parts' tensors are not kept."""
    if not all(is_plain_linear(p) for p in parts) or len({p.out_features for p in parts}) > 1:
        return None
    if len({p.bias is None for p in parts}) > 1:
        return None
    w = torch.cat([p.weight for p in parts], dim=1)
    out = Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=parts[0].weight.requires_grad)
    if parts[0].bias is not None:
        bias = sum(p.bias.float() for p in parts).to(parts[0].bias.dtype)
        out.bias = nn.Parameter(bias, requires_grad=parts[0].bias.requires_grad)
    return out
