"""The routed experts of a mixture-of-experts block: each token goes through the `top_k` experts
its router chose, and their outputs, times the routing weights, are summed.

    moe_experts(x, w_in, w_out, topk_ids, topk_weights, activation) -> [T, H] float32
    moe_experts(..., add=shared) -> [T, H] in shared's dtype: the sum rounded to it, plus shared

x: [T, H] tokens; topk_ids: [T, k] the chosen experts (int); topk_weights: [T, k] their weights,
float32 (NemotronH's router) or x's dtype (Granite's). activation "relu2": w_in [E, I, H] (up),
expert(x) = relu²(x W_up^T) W_down^T; "swiglu": w_in [E, 2I, H] with the gate rows first,
expert(x) = (silu(x W_gate^T) * x W_up^T) W_down^T. w_out: [E, H, I]. Each expert output is
rounded to x's dtype, multiplied by its weight in the weight's precision (so a model-dtype weight
gives a model-dtype product, as transformers computes it) and the products are summed in float32.

Two implementations, picked by `ops.dispatch.kernel_path("moe_experts", ...)`:

- the reference (`moe_experts_ref`, every device without the kernel) runs every expert densely
  over all tokens and weights it by the dense, mostly-zero routing matrix: E / k times the routed
  FLOPs, but no data-dependent shapes, so it never syncs;
- the Triton path (CUDA) runs only the routed (token, expert) pairs: they are sorted by expert
  on the device into blocks of one expert each (sizes from host-known bounds, real counts read on
  the device), and two grouped GEMMs run over the blocks (activation fused into the first, the
  weight multiply into the second), then the k products of each token are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaserve.ops.activation import relu2
from mambaserve.ops.dispatch import kernel_path

ACTIVATIONS = ("relu2", "swiglu")


def moe_experts(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                activation: str, add: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum per token, [T, H] float32 (see the module docstring);
    with `add` ([T, H], e.g. the shared expert's output), `sum.to(add.dtype) + add` (the kernel
    path does it in the pass that sums, instead of three)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown MoE activation {activation!r}; use one of {ACTIVATIONS}")
    if kernel_path("moe_experts", x.device) == "triton":
        from mambaserve.ops.triton.moe_experts import moe_experts_triton

        return moe_experts_triton(x, w_in, w_out, topk_ids, topk_weights, activation, add)
    out = moe_experts_ref(x, w_in, w_out, topk_ids, topk_weights, activation)
    return out if add is None else out.to(add.dtype) + add


def dense_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int) -> torch.Tensor:
    """[T, E] routing matrix in the weights' dtype: token t's weight for expert e, 0 if unrouted."""
    shape = (topk_ids.shape[0], num_experts)
    return torch.zeros(shape, dtype=topk_weights.dtype, device=topk_weights.device).scatter_(
        1, topk_ids.long(), topk_weights)


def expert_forward(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                   activation: str) -> torch.Tensor:
    """One expert over the rows of x, in x's dtype: w_in [I or 2I, H], w_out [H, I]."""
    if activation == "relu2":
        return relu2(x @ w_in.t()) @ w_out.t()
    gate, up = F.linear(x, w_in).split(w_out.shape[-1], dim=-1)
    return F.linear(F.silu(gate) * up, w_out)


def moe_experts_ref(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    activation: str) -> torch.Tensor:
    """Dense reference: every expert over every token, weighted by the routing matrix."""
    weights = dense_routing(topk_ids, topk_weights, w_in.shape[0])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_in.shape[0]):
        h = expert_forward(x, w_in[e], w_out[e], activation)
        out.add_(h * weights[:, e: e + 1])  # product in the weights' precision, sum in float32
    return out


def moe_experts_loop(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     activation: str) -> torch.Tensor:
    """What a user writes by hand: per expert, gather the tokens routed to it, run it, scatter
    back. Exact like the others, but it reads the routing on the host (one sync per expert), so
    it is only a benchmark peer and a test oracle, never used by the engine."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_in.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        h = expert_forward(x[tok], w_in[e], w_out[e], activation)
        out.index_add_(0, tok, (h * topk_weights[tok, slot, None]).float())
    return out
