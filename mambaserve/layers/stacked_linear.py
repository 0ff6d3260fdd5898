"""Several projections of the same input as one: their weights (and biases) stacked by rows into
one `Linear`, so a forward runs one GEMM (one weight read, one launch) and splits its output
by the parts' `out_features`. Used once the weights are final (loaded, folded, sharded):
`Attention.pack_qkv` and `DecoderLayer.pack_mixer_inputs`."""

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
