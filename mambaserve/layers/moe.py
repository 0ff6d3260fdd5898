"""NemotronH mixture of experts: sigmoid router with grouped top-k, relu^2 experts, shared expert.

Routing follows transformers' NemotronHTopkRouter exactly (scores = sigmoid(x W^T) in float32,
choice by scores + e_score_correction_bias within the top groups, weights from the unbiased
scores, optionally normalized, times routed_scaling_factor).

The expert loop is a dense reference on every device: each expert runs over all tokens and its
output is weighted by the (mostly zero) routing weight, so a step costs E / top_k times the
routed experts' FLOPs. It has no data-dependent shapes, so it never syncs and can be captured
in a CUDA graph. There is no sparse path (gathering each expert's routed tokens for a grouped
GEMM) yet; it is a planned issue.
"""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.layers.mlp import MLP
from mambaserve.ops.activation import relu2


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> dense routing weights [T, num_experts] float32 (zero if unrouted)."""
        scores = torch.sigmoid(x.float() @ self.weight.float().t())
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(-1, -1, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        topk_idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        topk_w = scores.gather(1, topk_idx)
        if self.norm_topk_prob:
            topk_w = topk_w / (topk_w.sum(-1, keepdim=True) + 1e-20)
        topk_w = topk_w * self.routed_scaling_factor
        return torch.zeros_like(scores).scatter_(1, topk_idx, topk_w)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = TopkRouter(cfg)
        # stacked expert weights, as transformers keeps them: up [E, I, H], down [E, H, I]
        self.experts_up = nn.Parameter(torch.empty(E, I, H))
        self.experts_down = nn.Parameter(torch.empty(E, H, I))
        self.shared_experts = MLP(H, cfg.moe_shared_expert_intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.gate(x)  # [T, E] float32
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(self.experts_up.shape[0]):
            h = relu2(x @ self.experts_up[e].t()) @ self.experts_down[e].t()
            out = out + h * weights[:, e: e + 1]
        return out.to(x.dtype) + self.shared_experts(x)
