"""The start of a forward that needs only the step's token ids: the embedding, the first layer's
norm and its first projection (a Mamba in_proj, or Falcon-H1's packed mixer projection).

A model that has one (`model.has_head`) computes it with `model.forward_head(input_ids)` and
finishes the forward from it with `model(meta, ..., head=that)`: the same kernels on the same
inputs as the whole forward, so the same bits. The prefill graphs (engine/prefill_graph.py) run
the head before the host plans the step, so that the device multiplies the first projection
while the host plans and uploads the rest (the time to first token's host part, docs/
cuda_graphs.md "Head start").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mambaserve.ops.fp8_matmul import Fp8Rows


@dataclass
class ForwardHead:
    """What `forward_head` leaves for the rest of the forward."""

    stream: torch.Tensor  # the residual stream after the embedding [T, hidden]
    normed: torch.Tensor | Fp8Rows  # the first layer's normed input (FP8 rows where the norm
    # writes them); the rest of the forward reads only its shape, dtype and device
    projected: torch.Tensor  # its first projection's output [T, out_features]
