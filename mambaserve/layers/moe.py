"""Mixture-of-experts feed-forward block, with the two router / expert kinds of the families
(`ModelConfig.moe_router`):

- "sigmoid_grouped" (NemotronH): routing follows transformers' NemotronHTopkRouter exactly
  (scores = sigmoid(x W^T) in float32, choice by scores + e_score_correction_bias within the top
  groups, weights from the unbiased scores, optionally normalized, times routed_scaling_factor);
  relu^2 experts (`experts_up` [E, I, H], `experts_down` [E, H, I]) and a relu^2 shared expert.
- "softmax_topk" (GraniteMoeHybrid): logits = x W^T in the model dtype (W kept in the model
  dtype, then cast to float32, as transformers' GraniteMoeHybridTopKRouter), weights = softmax
  over the top-k logits, cast back to the model dtype; no bias, groups or scaling. SwiGLU experts
  with the checkpoint's stacked [gate | up] weight (`experts_gate_up` [E, 2I, H], gate first,
  `experts_down` [E, H, I]) and a SwiGLU shared MLP (GatedMLP). Each expert's output times its
  weight is rounded to the model dtype and the products are summed in float32, as transformers'
  default (grouped_mm) experts path does.

The routed experts run through `ops.moe_experts`: sparse grouped GEMMs over the routed
(token, expert) pairs on CUDA, the dense reference (every expert over every token, weighted by the
mostly-zero routing matrix) elsewhere. Both are sync-free and capturable in a CUDA graph.

Tensor parallelism (`shard`) splits every expert, not the set of experts: each rank keeps the
same columns [r I/tp, (r+1) I/tp) of every expert's intermediate size (and of the shared expert's),
runs the replicated router and `moe_experts` unchanged on the smaller experts, and the partial
outputs of the routed and shared experts are added before one all-reduce per layer
(docs/tensor_parallel.md says why not expert parallelism).
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.parallel_modules import param_of, shard_range
from mambaserve.layers.mlp import MLP, GatedMLP
from mambaserve.layers.scaling import scale_
from mambaserve.ops.linear import linear, linear_float32
from mambaserve.ops.moe_experts import moe_experts
from mambaserve.ops.moe_routing import sigmoid_topk, softmax_topk


class TopkRouter(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size,
                                               dtype=torch.float32))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (chosen experts [T, top_k] int64, their weights [T, top_k] float32)."""
        logits = linear_float32(x, self.weight)  # float32, as transformers' router
        if self.topk_group >= self.n_group:  # every group kept: one op (a launch on CUDA)
            return sigmoid_topk(logits, self.e_score_correction_bias, self.top_k,
                                self.norm_topk_prob, self.routed_scaling_factor)
        scores = torch.sigmoid(logits)
        choice = self._keep_top_groups(scores + self.e_score_correction_bias)
        topk_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_w = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20)
        return topk_idx, topk_w * self.routed_scaling_factor

    def _keep_top_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """-inf outside the `topk_group` groups whose two best choice scores sum highest."""
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts)
        return choice.masked_fill(expert_mask == 0, float("-inf"))


class SoftmaxTopkRouter(nn.Module):
    """GraniteMoeHybrid's router: softmax over the k largest of x W^T (no bias, no groups)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (chosen experts [T, top_k] int64, their weights [T, top_k] in x's
        dtype)."""
        return softmax_topk(linear(x, self.weight), self.top_k, x.dtype)


MOE_ROUTERS = ("sigmoid_grouped", "softmax_topk")


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        S = cfg.moe_shared_expert_intermediate_size
        if cfg.moe_router not in MOE_ROUTERS:
            raise ValueError(f"unknown moe_router {cfg.moe_router!r}; use one of "
                             f"{', '.join(MOE_ROUTERS)}")
        self.swiglu = cfg.moe_router == "softmax_topk"
        self.tp = TPGroup.single()  # the group whose partial outputs `forward` all-reduces
        if self.swiglu:
            self.router = SoftmaxTopkRouter(cfg)
            # [gate | up] of each expert stacked as in the checkpoint: [E, 2I, H], gate first
            self.experts_gate_up = nn.Parameter(torch.empty(E, 2 * I, H))
            self.experts_down = nn.Parameter(torch.empty(E, H, I))
            self.shared_experts = GatedMLP(H, S, bias=cfg.mlp_bias)
            return
        self.gate = TopkRouter(cfg)
        # stacked expert weights, as transformers keeps them: up [E, I, H], down [E, H, I]
        self.experts_up = nn.Parameter(torch.empty(E, I, H))
        self.experts_down = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, S, bias=cfg.mlp_bias)

    def shard(self, tp: TPGroup) -> None:
        """Per-expert tensor parallelism: every expert keeps intermediate columns
        [r I/tp, (r+1) I/tp) (for SwiGLU, the same columns of its gate and its up half); the
        shared expert is column / row split without its own all-reduce; the router stays whole
        (replicated, the same routing on every rank). `forward` all-reduces once."""
        if tp.tp_size == 1:
            return
        I = self.experts_down.shape[-1]
        i0, i1 = shard_range(I, tp, "moe_intermediate_size")
        if self.swiglu:
            rows = torch.cat([torch.arange(i0, i1), I + torch.arange(i0, i1)])
            self.experts_gate_up = param_of(self.experts_gate_up[:, rows])
        else:
            self.experts_up = param_of(self.experts_up[:, i0:i1])
        self.experts_down = param_of(self.experts_down[:, :, i0:i1])
        self.shared_experts.shard(tp, reduce=False, what="moe_shared_expert_intermediate_size")
        self.tp = tp

    @torch.no_grad()
    def fold_scales(self, out_scale: float = 1.0) -> None:
        """Once after loading, before sharding: fold a scale of the block's output into every
        routed expert's down projection and into the shared expert (layers/scaling.py); the
        routing is untouched."""
        scale_(self.experts_down, out_scale)
        self.shared_experts.fold_scales(out_scale)

    @property
    def folds_residual(self) -> bool:
        """`forward(x, residual)` is taken: one rank (the residual must enter the sum once) and a
        shared expert whose down projection can add it."""
        return self.tp.tp_size == 1 and self.shared_experts.folds_residual

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual` (only where `folds_residual`): residual + the output, the residual added
        by the shared expert's down projection."""
        if self.swiglu:
            ids, weights = self.router(x)
            w_in, activation = self.experts_gate_up, "swiglu"
        else:
            ids, weights = self.gate(x)
            w_in, activation = self.experts_up, "relu2"
        # the routed sum rounded to the model dtype plus the shared expert's output (one pass on
        # the kernel path); sharded: both terms are this rank's partial sums, added before the
        # one all-reduce
        shared = self.shared_experts(x) if residual is None else self.shared_experts(x, residual)
        return self.tp.all_reduce(moe_experts(x, w_in, self.experts_down, ids, weights,
                                              activation, add=shared))
