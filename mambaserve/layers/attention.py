"""Grouped-query attention over the paged KV pool, with the options the hybrid families use:
projection biases, the softmax scale (Granite's attention_multiplier), a multiplier on the keys
(Falcon-H1; folded into k_proj by `fold_scales` at load time), and rotary position embedding on
the first `rotary_dim` channels of each head (NeoX pairs; none for NemotronH and Granite's
"nope")."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.parallel_modules import (
    RowParallelLinear,
    keep_rows,
    shard_or_replicate_range,
    shard_range,
)
from mambaserve.layers.linear import Linear, folds_residual, is_plain_linear, residual_projection
from mambaserve.layers.scaling import scale_linear_
from mambaserve.layers.stacked_linear import stacked_linear
from mambaserve.metadata import ForwardMetadata
from mambaserve.ops.linear import linear
from mambaserve.ops.paged_attention import DenseRows, paged_attention, write_kv
from mambaserve.ops.rotary import apply_rotary, rotary_cos_sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scale = cfg.attention_scale if cfg.attention_scale is not None \
            else self.head_dim ** -0.5
        self.key_multiplier = cfg.key_multiplier
        self.rope_theta = cfg.rope_theta
        self.rotary_dim = cfg.rotary_dim or self.head_dim
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.hidden_size = H  # o_proj's output width (every tensor-parallel rank)
        self.q_proj = Linear(H, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(H, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, H, bias=bias)
        self.qkv_proj: nn.Linear | None = None  # set by pack_qkv: q, k, v as one projection

    def rope_tables(self, meta: ForwardMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos / sin tables of this forward's positions (None without RoPE): every attention
        layer of a model has the same theta and rotary_dim, so the model computes them once per
        forward and hands them to each layer (a few launches per forward instead of per layer)."""
        if self.rope_theta is None:
            return None
        return rotary_cos_sin(meta.positions, self.rope_theta, self.rotary_dim)

    def shard(self, tp: TPGroup) -> None:
        """Keep this rank's query heads and the KV heads they read: KV heads split when tp
        divides num_kv_heads, else each rank's one KV head replicated (num_kv_heads divides tp);
        o_proj row-parallel (all-reduce). The rank's KV pool holds its KV heads only."""
        if tp.tp_size == 1:
            return
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q0, q1 = shard_range(Hq, tp, "num_attention_heads")
        k0, k1 = shard_or_replicate_range(Hkv, tp, "num_kv_heads")
        keep_rows(self.q_proj, torch.arange(q0 * D, q1 * D))
        for proj in (self.k_proj, self.v_proj):
            keep_rows(proj, torch.arange(k0 * D, k1 * D))
        self.o_proj = RowParallelLinear(self.o_proj, q0 * D, q1 * D, tp)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0

    @torch.no_grad()
    def fold_scales(self, in_scale: float = 1.0, out_scale: float = 1.0) -> None:
        """Once after loading, before sharding: fold a scale of the input (q, k, v weights), the
        key multiplier (k's weight and bias; RoPE is linear, so before or after it is the same)
        and a scale of the output (o_proj) into the weights (layers/scaling.py)."""
        scale_linear_(self.q_proj, 1.0, in_scale)
        scale_linear_(self.k_proj, self.key_multiplier, in_scale)
        scale_linear_(self.v_proj, 1.0, in_scale)
        scale_linear_(self.o_proj, out_scale)
        self.key_multiplier = 1.0

    def pack_qkv(self) -> None:
        """Once the weights are final (loaded, folded, sharded; the engine calls it last): q, k
        and v become one projection whose rows are q's, k's, then v's (`stacked_linear`), one
        GEMM instead of three. Left as three when any of them is FP8. The three are dropped."""
        if self.qkv_proj is not None or "q_proj" not in self._modules:  # packed already
            return
        qkv = stacked_linear([self.q_proj, self.k_proj, self.v_proj])
        if qkv is not None:
            self.qkv_proj = qkv
            del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor, qkv: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, D = x.shape[0], self.head_dim
        if qkv is not None or self.qkv_proj is not None:  # views of one GEMM's output
            q, k, v = (qkv if qkv is not None else self.qkv_proj(x)).split(
                [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D),
                v.view(T, self.num_kv_heads, D))

    @property
    def folds_residual(self) -> bool:
        """`forward(..., residual=)` is taken: o_proj is a plain projection without bias."""
        return folds_residual(self.o_proj)

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, kv_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                qkv: torch.Tensor | None = None, add: torch.Tensor | None = None,
                into: torch.Tensor | None = None,
                residual: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden]; kv_cache: this layer's [2, pages + 1, page_size, H_kv, head_dim];
        rope: `rope_tables(meta)` of the forward (computed here when None); qkv: the packed
        q / k / v projection of x when the layer computed it together with Mamba's in_proj;
        add [T, hidden]: returned added to the output (Falcon-H1's Mamba output), by o_proj's
        own launch where o_proj is a plain projection. `into` [T, heads x head_dim] (o_proj is
        then the caller's: `DecoderLayer.pack_mixer_projections`): the attention output, before
        o_proj, is written there and returned. `residual` [T, hidden] (only where
        `folds_residual`, without `add` or `into`): returns residual + the output, added by
        o_proj's launch. `out_rows` (not with `into`): the output of those rows only (`residual`
        / `add` hold theirs): every row's K / V is written and attended, o_proj takes those
        (models/output_rows.py)."""
        T = x.shape[0]
        q, k, v = self._qkv(x, qkv)
        if self.key_multiplier != 1.0:  # unfolded (tests); fold_scales moves it into k's rows
            k = k * self.key_multiplier
        if self.rope_theta is not None:
            q, k = apply_rotary(q, k, meta.positions, self.rope_theta, self.rotary_dim,
                                cos_sin=rope)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        spans = meta.prefill.row_spans if meta.prefill is not None else None
        out = paged_attention(q, kv_cache, meta.page_table, meta.token_row, meta.positions,
                              meta.max_kv_len, self.scale, meta.num_prefill_tokens,
                              None if into is None else into.view(q.shape),
                              dense=None if spans is None else DenseRows(k, v, spans))
        if into is not None:
            return into
        out = out.reshape(T, -1)
        if out_rows is not None:
            assert into is None, "out_rows takes the layer's own o_proj"
            out = out.index_select(0, out_rows)
            if out_rows.shape[0] == 0:  # no row's output is read
                return out.new_empty(0, self.hidden_size)
        if residual is not None:
            assert add is None, "residual and add are not taken together"
            return residual_projection(self.o_proj, out, residual)
        if add is None:
            return self.o_proj(out)
        if is_plain_linear(self.o_proj):
            return linear(out, self.o_proj.weight, self.o_proj.bias, add=add)
        return self.o_proj(out) + add
