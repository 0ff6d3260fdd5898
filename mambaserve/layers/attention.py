"""Grouped-query attention without positional encoding (NemotronH), over the paged KV pool."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.metadata import ForwardMetadata
from mambaserve.ops.paged_attention import paged_attention, write_kv


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scale = self.head_dim ** -0.5
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, kv_cache: torch.Tensor
                ) -> torch.Tensor:
        """x: [T, hidden]; kv_cache: this layer's [2, pages + 1, page_size, H_kv, head_dim]."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, kv_cache, meta.page_table, meta.token_row, meta.positions,
                              meta.max_kv_len, self.scale, meta.num_prefill_tokens)
        return self.o_proj(out.reshape(T, -1))
