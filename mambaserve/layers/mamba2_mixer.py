"""Mamba2 mixer: in_proj -> [z | xBC | dt] -> causal conv1d -> SSD scan / state update ->
gated RMSNorm -> out_proj. Prefill rows (first) and decode rows (last) of one flat batch take
different ops; both read and write the layer's slice of the state pool in place.

Family options (ModelConfig): in_proj / out_proj biases, per-segment multipliers of the in_proj
output (Falcon-H1's ssm_multipliers on z, x, B, C, dt; `fold_scales` folds them into in_proj at
load time), the gated-norm variant (every one a Triton kernel on CUDA), and the dt clamps of the
two paths."""

from __future__ import annotations

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.distributed.group import TPGroup
from mambaserve.distributed.parallel_modules import (
    RowParallelLinear,
    keep_rows,
    param_of,
    shard_or_replicate_range,
    shard_range,
)
from mambaserve.layers.fp8_linear import is_dynamic_fp8
from mambaserve.layers.linear import Linear, folds_residual, is_plain_linear, residual_projection
from mambaserve.layers.scaling import scale_linear_
from mambaserve.metadata import ForwardMetadata, PrefillMetadata
from mambaserve.ops.conv1d import causal_conv1d_update, causal_conv1d_varlen
from mambaserve.ops.gated_rmsnorm import (
    NormSpan,
    gated_rmsnorm,
    gated_rmsnorm_ref,
    gated_silu,
)
from mambaserve.ops.linear import linear
from mambaserve.ops.selective_state_update import selective_state_update
from mambaserve.ops.ssd import ssd_chunk_scan_varlen
from mambaserve.ops.state_snapshot import save_prefill_conv_snapshots


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.n_groups, self.state_size = cfg.n_groups, cfg.ssm_state_size
        self.d_inner = cfg.mamba_intermediate_size
        self.conv_dim = cfg.conv_dim
        self.hidden_size = cfg.hidden_size  # out_proj's output width (every tensor-parallel rank)
        self.norm_eps = cfg.norm_eps
        self.prefill_dt_limit, self.decode_dt_limit = cfg.prefill_dt_limit, cfg.decode_dt_limit
        self.in_proj = Linear(cfg.hidden_size, self.d_inner + self.conv_dim + self.num_heads,
                                 bias=cfg.mamba_in_proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, cfg.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim)) if cfg.use_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm_kind = cfg.mamba_norm
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner)) \
            if cfg.mamba_norm != "none" else None
        # the gated norm multiplies by its weight in float32 before the one cast back
        # (Falcon-H1's FalconH1RMSNormGated); False: cast, then weight
        self.norm_weight_fp32 = cfg.mamba_norm_weight_fp32
        # set by `shard` when this rank's channels are part of a norm group spanning ranks
        self.norm_span: NormSpan | None = None
        self.out_proj = Linear(self.d_inner, cfg.hidden_size, bias=cfg.mamba_out_proj_bias)
        # in_proj output multipliers per segment (z, x, B, C, dt), not in the checkpoint:
        # (start, end, multiplier) of the segments whose multiplier is not 1. Plain numbers, not
        # a buffer (the loader fills every buffer from the checkpoint), each rounded to the dtype
        # the model is built in, as transformers' mup_vector buffer is.
        dtype = torch.get_default_dtype()
        self.segment_multipliers = [torch.tensor(float(m), dtype=dtype, device="cpu").item()
                                    for m in cfg.ssm_proj_multipliers]
        self.proj_multipliers = self._proj_multipliers()
        self._A: tuple[torch.Tensor, tuple, torch.Tensor] | None = None  # see decay_rates

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) in float32, computed once and kept while A_log is the same tensor
        with the same version counter and storage (loading, sharding, moving, casting or a
        test's in-place copy recompute it), instead of three launches per layer per forward."""
        a = self.A_log
        state = (a._version, a.data_ptr())
        if self._A is None or self._A[0] is not a or self._A[1] != state:
            # a plain tensor (not an inference tensor), usable by forwards in and out of
            # inference mode; no autograd history (A_log is not trained here)
            with torch.inference_mode(False), torch.no_grad():
                self._A = (a, state, -torch.exp(a.detach().float()))
        return self._A[2]

    def _proj_multipliers(self) -> list[tuple[int, int, float]]:
        GN = self.n_groups * self.state_size
        sizes = (self.d_inner, self.d_inner, GN, GN, self.num_heads)
        ends = [sum(sizes[:i + 1]) for i in range(5)]
        return [(end - n, end, m)
                for n, end, m in zip(sizes, ends, self.segment_multipliers) if m != 1.0]

    def shard(self, tp: TPGroup) -> None:
        """Keep this rank's heads (Megatron): in_proj's z, x, dt rows and conv / A / D / dt_bias
        / norm channels of heads [r H/tp, (r+1) H/tp); B and C of the groups those heads read
        (split when tp divides n_groups, else the one group, replicated, when n_groups divides
        tp); out_proj row-parallel (all-reduce). The gated norm stays local when tp divides
        n_groups; else this rank's channels are part of one norm group shared by tp / n_groups
        ranks, whose sum of squares is all-reduced (`NormSpan`, the torch path). Call after the
        weights are loaded."""
        if tp.tp_size == 1:
            return
        H, G, N, D, P = (self.num_heads, self.n_groups, self.state_size, self.d_inner,
                         self.head_dim)
        h0, h1 = shard_range(H, tp, "mamba_num_heads")
        g0, g1 = shard_or_replicate_range(G, tp, "n_groups")
        ch = torch.arange(h0 * P, h1 * P)
        bc = torch.arange(g0 * N, g1 * N)
        GN = G * N
        keep_rows(self.in_proj, torch.cat([ch, D + ch, 2 * D + bc, 2 * D + GN + bc,
                                           2 * D + 2 * GN + torch.arange(h0, h1)]))
        conv = torch.cat([ch, D + bc, D + GN + bc])
        self.conv_weight = param_of(self.conv_weight[conv])
        if self.conv_bias is not None:
            self.conv_bias = param_of(self.conv_bias[conv])
        for name in ("dt_bias", "A_log", "D"):
            setattr(self, name, param_of(getattr(self, name)[h0:h1]))
        if self.norm_weight is not None:
            self.norm_weight = param_of(self.norm_weight[ch])
        self.out_proj = RowParallelLinear(self.out_proj, h0 * P, h1 * P, tp)
        if G < tp.tp_size:  # norm group g0 spans tp / G ranks: its sum of squares is all-reduced
            self.norm_span = NormSpan(D // G, g0, G, tp.all_reduce)
        self.num_heads, self.n_groups, self.d_inner = h1 - h0, g1 - g0, (h1 - h0) * P
        self.conv_dim = self.d_inner + 2 * self.n_groups * N
        self.proj_multipliers = self._proj_multipliers()

    @torch.no_grad()
    def fold_scales(self, in_scale: float = 1.0, out_scale: float = 1.0) -> None:
        """Once after loading, before sharding: fold the in_proj segment multipliers, a scale of
        the mixer's input (in_proj's weight) and one of its output (out_proj's) into the
        weights (layers/scaling.py); the forward then multiplies by none of them."""
        rows = torch.ones(self.in_proj.out_features, dtype=torch.float64)
        for start, end, m in self.proj_multipliers:
            rows[start:end] = m
        scale_linear_(self.in_proj, rows, in_scale)
        scale_linear_(self.out_proj, out_scale)
        self.segment_multipliers = [1.0] * 5
        self.proj_multipliers = []

    def takes_fp8_rows(self) -> bool:
        """in_proj is FP8 of dynamic scales: x may come as `Fp8Rows` (`forward` reads only its
        shape, dtype and device besides in_proj)."""
        return is_dynamic_fp8(self.in_proj)

    def _heads(self, xBC: torch.Tensor, dt: torch.Tensor, A: torch.Tensor):
        """The conv output's x [T, H, P], dt, A, B and C [T, G, N] (views), in the argument
        order of the scan and the state update."""
        G, N, T = self.n_groups, self.state_size, xBC.shape[0]
        xs, B, C = xBC.split([self.d_inner, G * N, G * N], dim=-1)
        return (xs.reshape(T, self.num_heads, self.head_dim), dt, A, B.reshape(T, G, N),
                C.reshape(T, G, N))

    def forward(self, x: torch.Tensor, meta: ForwardMetadata, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, zxbcdt: torch.Tensor | None = None,
                into: torch.Tensor | None = None,
                residual: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden]; conv_state: [slots + 1, K-1, conv_dim]; ssm_state: [slots + 1, H, P, N].
        `zxbcdt`: in_proj(x) when the layer computed it in a packed projection (in_proj is then
        None: `DecoderLayer.pack_mixer_projections`). `into` [T, d_inner] (out_proj is then the
        caller's, packed likewise): the gated norm's output is written there and returned.
        `residual` [T, hidden] (only where `folds_residual`): returns residual + the output,
        added by out_proj's launch (`layers.linear.residual_projection`). `out_rows` (not with
        `into`): the output of those rows only, [len(out_rows), hidden] (`residual` holds
        theirs): the scan and the state updates take every row, the gated norm and out_proj
        those, and z, which only the gated norm reads, is projected for those rows alone where
        in_proj is plain (`_can_split_in_proj`), and the scan's output launches run on their chunks
        (`_out_chunks`; models/output_rows.py)."""
        T = x.shape[0]
        Tp = meta.num_prefill_tokens
        H, P = self.num_heads, self.head_dim
        if zxbcdt is None and out_rows is not None and self._can_split_in_proj:
            z_rows, xBC, dt = self._in_proj_split(x, out_rows)
        else:
            z_rows = None
            if zxbcdt is None:
                zxbcdt = self.in_proj(x)
            for start, end, m in self.proj_multipliers:  # in place on in_proj's fresh output
                zxbcdt[:, start:end].mul_(m)
            z, xBC, dt = zxbcdt.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        A = self.decay_rates()
        # mixed batches assemble y from both paths; single-kind batches use that path's output
        y = torch.empty(T, H, P, dtype=x.dtype, device=x.device) \
            if meta.num_prefills and meta.num_decodes else None

        pf = meta.prefill
        if pf is not None:
            if pf.num_snapshots:  # before the conv overwrites the rows' windows
                save_prefill_conv_snapshots(xBC[:Tp], conv_state, pf.state_slots,
                                            pf.has_initial_state, pf.snap_conv_idx, pf.snap_dst)
            xBC_p = causal_conv1d_varlen(
                xBC[:Tp], self.conv_weight, self.conv_bias, conv_state, pf.state_slots,
                pf.has_initial_state, pf.conv_window_idx, pf.conv_state_idx)
            y_p = ssd_chunk_scan_varlen(
                *self._heads(xBC_p, dt[:Tp], A), self.D, self.dt_bias, self.prefill_dt_limit,
                ssm_state, pf.state_slots,
                pf.has_initial_state, pf.chunk_token_idx, pf.token_chunk_pos,
                pf.row_chunks, pf.row_num_chunks,
                pf.chunk_snap_dst if pf.num_snapshots else None, _out_chunks(pf, out_rows, Tp))
            if meta.num_decodes:
                y[:Tp] = y_p
            else:  # prefill-only batch: the scan's output is y (no copy)
                y = y_p
        if meta.num_decodes:
            slots = meta.decode_state_slots
            # prefix caching: the rows' new states also go to their snapshot slots, written by
            # the conv step and the state update themselves (no launch of their own)
            snap = meta.decode_snap_dst if meta.num_decode_snapshots else None
            xBC_d = causal_conv1d_update(xBC[Tp:], self.conv_weight, self.conv_bias, conv_state,
                                         slots, snap_dst=snap)
            y_d = selective_state_update(ssm_state, *self._heads(xBC_d, dt[Tp:], A), self.D,
                                         self.dt_bias, self.decode_dt_limit, slots, snap)
            if pf is not None:
                y[Tp:] = y_d
            else:  # decode-only batch: no copy
                y = y_d

        y = y.reshape(T, self.d_inner)
        if out_rows is not None:
            assert into is None, "out_rows takes the layer's own out_proj"
            y = y.index_select(0, out_rows)
            z = z.index_select(0, out_rows) if z_rows is None else z_rows
            if out_rows.shape[0] == 0:  # no row's output is read
                return y.new_empty(0, self.hidden_size)
        if into is not None:
            return self._gated_norm(y, z, into)
        # an FP8 out_proj of dynamic scales gets FP8 rows from the gated norm's pass
        quantize = is_dynamic_fp8(self.out_proj) and self.norm_kind != "none" \
            and self.norm_span is None
        g = self._gated_norm(y, z, quantize=quantize)
        if residual is not None:
            return residual_projection(self.out_proj, g, residual)
        return self.out_proj(g)

    @property
    def _can_split_in_proj(self) -> bool:
        """in_proj can run as two products, z's rows of its weight on a few token rows and the
        rest on every row: a plain projection (not FP8, not packed with attention's) whose
        output takes no multiplier."""
        return is_plain_linear(self.in_proj) and not self.proj_multipliers

    def _in_proj_split(self, x: torch.Tensor, rows: torch.Tensor):
        """in_proj(x) as (z at `rows` only, xBC, dt): the same weight rows in two products."""
        w, b, D = self.in_proj.weight, self.in_proj.bias, self.d_inner
        z = linear(x.index_select(0, rows), w[:D], None if b is None else b[:D])
        xbcdt = linear(x, w[D:], None if b is None else b[D:])
        return (z, *xbcdt.split([self.conv_dim, self.num_heads], dim=-1))

    @property
    def folds_residual(self) -> bool:
        """`forward(..., residual=)` is taken: out_proj is a plain projection without bias."""
        return folds_residual(self.out_proj)

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor, into: torch.Tensor | None = None,
                    quantize: bool = False):
        if self.norm_kind == "none":  # Falcon-H1 without the norm: y * silu(z), Triton on CUDA
            return gated_silu(y, z, into)
        group = self.d_inner // self.n_groups
        norm_first = self.norm_kind == "norm_then_gate"
        if self.norm_span is None:  # every variant (Falcon-H1's included): Triton on CUDA
            return gated_rmsnorm(y, z, self.norm_weight, group, self.norm_eps,
                                 norm_before_gate=norm_first, weight_fp32=self.norm_weight_fp32,
                                 out=into, quantize=quantize)
        # a norm group spanning tensor-parallel ranks: the torch path with its all-reduce
        out = gated_rmsnorm_ref(y, z, self.norm_weight, group, self.norm_eps,
                                norm_before_gate=norm_first,
                                weight_fp32=self.norm_weight_fp32, span=self.norm_span)
        return out if into is None else into.copy_(out)


def _out_chunks(pf: PrefillMetadata, out_rows: torch.Tensor | None, Tp: int) -> torch.Tensor | None:
    """The scan chunks of the output rows (a decode row's: the last prefill token's) where they
    are fewer than the step's chunks: the scan's output launches run on those alone."""
    if out_rows is None or out_rows.shape[0] >= pf.chunk_token_idx.shape[0]:
        return None
    L = pf.chunk_token_idx.shape[1]
    return pf.token_chunk_pos.index_select(0, out_rows.clamp(max=Tp - 1)) // L
