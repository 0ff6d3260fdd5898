"""The decoder the hybrid families share (Falcon-H1, GraniteMoeHybrid, Bamba, Mamba2): each layer
is a mixer sub-block (a Mamba2 mixer, attention, or both in parallel, summed) and/or a
feed-forward sub-block, each pre-norm and residual, as described by `ModelConfig.layers`; the
family's multipliers apply where transformers applies them (docs/models.md), or, after
`fold_multipliers` (the loader calls it), are folded into the weights they scale
(docs/architecture.md, "Multipliers folded into the weights"). Flat token batches in, logits of
the rows `meta.logits_idx` selects out, like every model of the engine.

Module names are fixed here; each family module maps its checkpoint's tensor names onto them
(`NameMapper`): `embed_tokens`, `layers.{i}.input_layernorm`, `layers.{i}.mamba`,
`layers.{i}.self_attn`, `layers.{i}.pre_ff_layernorm`, `layers.{i}.feed_forward`,
`final_layernorm`, `lm_head`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.layers.attention import Attention
from mambaserve.layers.fp8_linear import takes_fp8_rows
from mambaserve.layers.linear import Linear, folds_residual, residual_projection
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.layers.mlp import MLP, GatedMLP
from mambaserve.layers.moe import MoE
from mambaserve.layers.norm import RMSNorm
from mambaserve.layers.scaling import scale_, scale_linear_
from mambaserve.layers.stacked_linear import stacked_linear, summed_linear
from mambaserve.metadata import ForwardMetadata
from mambaserve.model_layout import FFNKind, LayerSpec
from mambaserve.models.forward_head import ForwardHead
from mambaserve.models.output_rows import narrow, output_rows, tail_start
from mambaserve.ops.linear import residual_in_projections
from mambaserve.ops.state_snapshot import restore_snapshots


@dataclass
class Multipliers:
    """The multipliers the decoder applies itself, between its layers (1.0 = none). The layers
    hold their own: the mixer's in_proj segments, attention's key multiplier, GatedMLP's gate
    and down multipliers."""

    embedding: float = 1.0
    logits: float = 1.0
    residual: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> Multipliers:
        return cls(**{f.name: getattr(cfg, f"{f.name}_multiplier") for f in fields(cls)})


def make_ffn(cfg: ModelConfig, kind: FFNKind) -> nn.Module:
    if kind is FFNKind.SWIGLU:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias,
                        cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier)
    if kind is FFNKind.RELU2:
        return MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
    return MoE(cfg)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        if spec.has_mixer:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if spec.mamba:
            self.mamba = Mamba2Mixer(cfg)
        if spec.attention:
            self.self_attn = Attention(cfg)
        if spec.ffn is not FFNKind.NONE:
            self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.feed_forward = make_ffn(cfg, spec.ffn)
        # set by pack_mixer_projections
        self.mixer_in: nn.Linear | None = None
        self.mixer_out: nn.Linear | None = None
        # the norms write FP8 rows for the mixer / FFN (`HybridForCausalLM.route_fp8_inputs`)
        self.fp8_mixer_input = self.fp8_ffn_input = False

    def pack_mixer_projections(self, inputs: bool = True, outputs: bool = True) -> None:
        """A layer with both mixers (Falcon-H1) projects the same normed input twice and adds
        two projected outputs: Mamba's in_proj and attention's packed q / k / v become one
        projection (`stacked_linear`, in_proj's rows first), and o_proj and out_proj one
        projection of the two mixers' outputs side by side (`summed_linear`, attention's
        columns first): one GEMM each per layer. Only after `Attention.pack_qkv`, with the parts
        in the model dtype (not FP8), the gated norm local to the rank, and the multipliers
        that `inputs` / `outputs` vouch for folded into the weights."""
        if not (self.spec.mamba and self.spec.attention):
            return
        m, a = self.mamba, self.self_attn
        if (inputs and self.mixer_in is None and a.qkv_proj is not None
                and not m.proj_multipliers and a.key_multiplier == 1.0):
            both = stacked_linear([m.in_proj, a.qkv_proj])
            if both is not None:
                self.mixer_in = both
                self.mixer_in_split = [m.in_proj.out_features, a.qkv_proj.out_features]
                m.in_proj = a.qkv_proj = None  # their rows live in mixer_in
        if outputs and self.mixer_out is None and m.norm_span is None:
            both = summed_linear([a.o_proj, m.out_proj])
            if both is not None:
                self.mixer_out = both
                self.mixer_out_split = [a.o_proj.in_features, m.out_proj.in_features]
                a.o_proj = m.out_proj = None  # their columns live in mixer_out

    def mixer_folds_residual(self, m: Multipliers) -> bool:
        """The mixers' closing projection can add the residual stream (`_mixers(residual=)`):
        the packed output projection, or a lone mixer's own, plain and without bias, with no
        multiplier of the output left unfolded."""
        if m.residual != 1.0:
            return False
        if self.mixer_out is not None:
            return folds_residual(self.mixer_out)
        if self.spec.mamba and not self.spec.attention:
            return m.ssm_in == m.ssm_out == 1.0 and self.mamba.folds_residual
        if self.spec.attention and not self.spec.mamba:
            return m.attention_in == m.attention_out == 1.0 and self.self_attn.folds_residual
        return False

    def ffn_folds_residual(self, m: Multipliers) -> bool:
        """The feed-forward's down projection (an MoE's shared expert's) can add the residual
        stream."""
        return m.residual == 1.0 and getattr(self.feed_forward, "folds_residual", False)


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mamba_index = {i: n for n, i in enumerate(cfg.mamba_layer_ids)}
        self.attention_index = {i: n for n, i in enumerate(cfg.attention_layer_ids)}
        self.multipliers = Multipliers.of(cfg)
        # the sub-blocks in order, (layer, "mixer" | "ffn"); from `tail_start` on only the
        # logits rows are computed (models/output_rows.py): a lone mixer's (Mamba or attention)
        # output part takes `out_rows`
        parts = [(i, p) for i, spec in enumerate(cfg.layers)
                 for p, has in (("mixer", spec.has_mixer), ("ffn", spec.ffn is not FFNKind.NONE))
                 if has]
        lone = [p == "mixer" and cfg.layers[i].mamba != cfg.layers[i].attention
                for i, p in parts]
        start = tail_start([p == "mixer" for _, p in parts], lone)
        self.tail_start = None if start is None else parts[start]

    def pack_mixer_projections(self) -> None:
        """Every layer with both mixers: one input and one output projection
        (`DecoderLayer.pack_mixer_projections`); called by the engine once the weights are final,
        after `Attention.pack_qkv`. The inputs only once the multipliers of the mixers' inputs
        are folded into the weights (`fold_multipliers`), the outputs once those of their inputs
        and outputs are (the packed forward applies none)."""
        m = self.multipliers
        inputs = m.ssm_in == 1.0 and m.attention_in == 1.0
        outputs = inputs and m.ssm_out == 1.0 and m.attention_out == 1.0
        for layer in self.layers:
            layer.pack_mixer_projections(inputs, outputs)

    def tie_lm_head(self) -> None:
        """Share the embedding matrix as the output projection (checkpoints without lm_head)."""
        self.lm_head.weight = self.embed_tokens.weight

    def route_fp8_inputs(self) -> None:
        """Once the weights are final: a sub-block whose first projection is FP8 of dynamic
        scales gets its input from the norm as FP8 rows (ops/rmsnorm.py: quantized in the
        norm's pass instead of one of its own). Mixers only where Mamba is the layer's one
        mixer and the normed input reaches it unscaled (folded multipliers)."""
        lone_mamba_input = self.multipliers.ssm_in == 1.0
        for layer in self.layers:
            spec = layer.spec
            layer.fp8_mixer_input = (spec.mamba and not spec.attention and lone_mamba_input
                                     and takes_fp8_rows(layer.mamba))
            layer.fp8_ffn_input = (spec.ffn is not FFNKind.NONE
                                   and takes_fp8_rows(layer.feed_forward))

    @torch.no_grad()
    def fold_multipliers(self) -> None:
        """Fold every multiplier that scales a projection's input or output into its weights,
        once, after loading and before sharding (layers/scaling.py: float32, one cast): the
        residual multiplier and the mixers' in / out multipliers into in_proj, out_proj, q / k /
        v and o_proj, the FFN's down projections; the embedding multiplier into the embedding
        table; the logits multiplier into lm_head, or, when lm_head shares the embedding table,
        into the final norm's weight (divided by the embedding multiplier the shared table now
        carries). The forward then applies none of them (the attention softmax scale stays the
        attention's own)."""
        for layer in self.layers:
            self.fold_layer(layer)
        self.fold_outer()

    @torch.no_grad()
    def fold_layer(self, layer: DecoderLayer) -> None:
        """`fold_multipliers`' part for one decoder layer (a loader that shards layer by layer
        folds each before sharding it, then calls `fold_outer`)."""
        m, r = self.multipliers, self.multipliers.residual
        if layer.spec.mamba:
            layer.mamba.fold_scales(m.ssm_in, m.ssm_out * r)
        if layer.spec.attention:
            layer.self_attn.fold_scales(m.attention_in, m.attention_out * r)
        if layer.spec.ffn is not FFNKind.NONE:
            layer.feed_forward.fold_scales(r)

    @torch.no_grad()
    def fold_outer(self) -> None:
        """`fold_multipliers`' part outside the layers (embedding, lm_head or the final norm),
        after every layer's: the multipliers then read 1."""
        m = self.multipliers
        scale_(self.embed_tokens.weight, m.embedding)
        if self.lm_head.weight is self.embed_tokens.weight:
            scale_(self.final_layernorm.weight, m.logits / m.embedding)
        else:
            scale_linear_(self.lm_head, m.logits)
        self.multipliers = Multipliers()

    def _norm(self, norm: RMSNorm, h: torch.Tensor, pending: torch.Tensor | None,
              quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """h += pending (the previous sub-block's output), then norm(h): one pass when fused;
        `quantize`: the normed rows as FP8 rows."""
        if pending is None:
            return norm(h.to(self.embed_tokens.weight.dtype), quantize=quantize), h
        # residual_in_fp32: h is float32 and the fused norm normalizes h + pending rounded to the
        # model dtype (ops/rmsnorm.py), as norm((h + pending).to(dtype)) would
        return norm(pending, h, quantize=quantize)

    def _mixers(self, i: int, layer: DecoderLayer, x: torch.Tensor, meta: ForwardMetadata,
                conv_state, ssm_state, kv_cache, rope, residual: torch.Tensor | None = None,
                projected: torch.Tensor | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Layer i's mixer sub-block on its normed input x: Mamba's output, attention's, or
        both added (the residual multiplier not applied). `residual` (only where
        `layer.mixer_folds_residual`): returns residual + that, added by the closing
        projection. `projected`: the first projection's output, already computed
        (`forward_head`). `out_rows`: a lone mixer's output at those rows only (`residual`
        holds theirs)."""
        spec, mult = layer.spec, self.multipliers
        zxbcdt = qkv = None
        if layer.mixer_in is not None:  # both mixers' input projections in one GEMM
            both = layer.mixer_in(x) if projected is None else projected
            zxbcdt, qkv = both.split(layer.mixer_in_split, dim=-1)
        elif projected is not None:  # a lone Mamba mixer's in_proj (`has_head`)
            zxbcdt = projected
        if layer.mixer_out is not None:  # both outputs side by side, one projection
            both = torch.empty(x.shape[0], layer.mixer_out.in_features, dtype=x.dtype,
                               device=x.device)
            into_a, into_m = both.split(layer.mixer_out_split, dim=-1)
            n = self.mamba_index[i]
            layer.mamba(x, meta, conv_state[n], ssm_state[n], zxbcdt, into=into_m)
            layer.self_attn(x, meta, kv_cache[self.attention_index[i]], rope, qkv, into=into_a)
            if residual is not None:
                return residual_projection(layer.mixer_out, both, residual)
            return layer.mixer_out(both)
        if residual is not None and spec.mamba:  # the lone mixers of mixer_folds_residual
            n = self.mamba_index[i]
            return layer.mamba(x, meta, conv_state[n], ssm_state[n], zxbcdt, residual=residual,
                               out_rows=out_rows)
        if residual is not None:
            return layer.self_attn(x, meta, kv_cache[self.attention_index[i]], rope, qkv,
                                   residual=residual, out_rows=out_rows)
        out = None
        if spec.mamba:
            n = self.mamba_index[i]
            xm = x * mult.ssm_in if mult.ssm_in != 1.0 else x
            out = layer.mamba(xm, meta, conv_state[n], ssm_state[n], zxbcdt, out_rows=out_rows)
            if mult.ssm_out != 1.0:
                out = out * mult.ssm_out
        if spec.attention:
            xa = x * mult.attention_in if mult.attention_in != 1.0 else x
            # both mixers: o_proj's launch adds the Mamba output (no add of its own)
            add = out if mult.attention_out == 1.0 else None
            a = layer.self_attn(xa, meta, kv_cache[self.attention_index[i]], rope, qkv, add,
                                out_rows=out_rows)
            if mult.attention_out != 1.0:
                a = a * mult.attention_out
            out = a if out is None or add is not None else out + a
        return out

    @property
    def has_head(self) -> bool:
        """The first layer's first projection needs the token ids only: a lone Mamba mixer's
        in_proj or the packed projection of both mixers (models/forward_head.py)."""
        layer = self.layers[0]
        spec = layer.spec
        return layer.mixer_in is not None or (spec.mamba and not spec.attention)

    def _fold(self, h: torch.Tensor, rows: int) -> bool:
        """A sub-block of `rows` token rows whose closing projection can add h in its epilogue
        returns h + its output (`residual_in_projections`; h in the model dtype); the others
        leave the add to the next norm's pass."""
        return residual_in_projections(rows, h.device) and h.dtype == self.embed_tokens.weight.dtype

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream's start: the embedding (times its multiplier; float32 where the
        stream is)."""
        h = self.embed_tokens(input_ids)
        if self.multipliers.embedding != 1.0:
            h = h * self.multipliers.embedding
        return h.float() if self.cfg.residual_in_fp32 else h

    def forward_head(self, input_ids: torch.Tensor) -> ForwardHead:
        """The embedding, the first layer's input norm and its first projection (`has_head`)."""
        layer = self.layers[0]
        h = self._embed(input_ids)
        x, h = self._norm(layer.input_layernorm, h, None, layer.fp8_mixer_input)
        if layer.mixer_in is not None:
            return ForwardHead(h, x, layer.mixer_in(x))
        ssm_in = self.multipliers.ssm_in
        return ForwardHead(h, x, layer.mamba.in_proj(x * ssm_in if ssm_in != 1.0 else x))

    def forward(self, meta: ForwardMetadata, conv_state: torch.Tensor | None,
                ssm_state: torch.Tensor | None, kv_cache: torch.Tensor | None,
                head: ForwardHead | None = None) -> torch.Tensor:
        """Logits [len(meta.logits_idx), vocab] float32 (see NemotronHForCausalLM.forward;
        `head` likewise)."""
        if meta.prefill is not None and meta.prefill.num_restores:
            restore_snapshots(conv_state, ssm_state, meta.prefill.restore_src,
                              meta.prefill.restore_dst)
        mult = self.multipliers  # all 1.0 once folded into the weights
        h = self._embed(meta.input_ids) if head is None else head.stream
        pending = None  # the last sub-block's output, not yet added to h
        fold = self._fold(h, h.shape[0])  # the closing projections add h (prefill-sized steps)
        first_attn = next(iter(self.attention_index), None)  # its RoPE tables serve every layer
        rope = self.layers[first_attn].self_attn.rope_tables(meta) if first_attn is not None \
            else None
        # the tail on the logits rows alone (None: on every row; models/output_rows.py)
        rows = output_rows(meta.logits_idx, h.shape[0]) if self.tail_start is not None else None
        narrowed = False  # h (and pending) hold the logits rows only
        for i, layer in enumerate(self.layers):
            spec = layer.spec
            if spec.has_mixer:
                early = head if i == 0 else None
                if early is not None:
                    x, p = early.normed, early.projected
                else:
                    x, h = self._norm(layer.input_layernorm, h, pending, layer.fp8_mixer_input)
                    p = None
                sel = rows if rows is not None and self.tail_start == (i, "mixer") else None
                if fold and layer.mixer_folds_residual(mult):
                    res = h if sel is None else h.index_select(0, sel)
                    h = self._mixers(i, layer, x, meta, conv_state, ssm_state, kv_cache, rope,
                                     res, p, sel)
                    pending = None
                else:
                    out = self._mixers(i, layer, x, meta, conv_state, ssm_state, kv_cache, rope,
                                       projected=p, out_rows=sel)
                    pending = out * mult.residual if mult.residual != 1.0 else out
                    h = h if sel is None else h.index_select(0, sel)
                if sel is not None:
                    fold, narrowed = self._fold(h, sel.shape[0]), True
            if spec.ffn is not FFNKind.NONE:
                if rows is not None and self.tail_start == (i, "ffn"):
                    h, pending = narrow(h, pending, rows)
                    fold, narrowed = self._fold(h, rows.shape[0]), True
                if narrowed and rows.shape[0] == 0:
                    break  # no row's output is read (a prompt's middle chunk)
                x, h = self._norm(layer.pre_ff_layernorm, h, pending, layer.fp8_ffn_input)
                if fold and layer.ffn_folds_residual(mult):
                    h, pending = layer.feed_forward(x, h), None
                else:
                    out = layer.feed_forward(x)
                    pending = out * mult.residual if mult.residual != 1.0 else out
        if not narrowed:  # only the rows whose logits are needed take the last add and the norm
            h, pending = narrow(h, pending, meta.logits_idx)
        if pending is not None:
            h = h + pending
        logits = self.lm_head(self.final_layernorm(h).to(self.lm_head.weight.dtype))
        if mult.logits != 1.0:
            logits = logits * mult.logits
        return logits.float()


# our parameter names that a checkpoint tensor of the same size but another shape may fill
RESHAPEABLE = ("conv_weight", "gate_up_weight", "gate_up_bias")

# separate gate_proj / up_proj tensors (Falcon-H1, Bamba) fill the halves of GatedMLP's stack
GATE_UP_SPLITS = [(r"feed_forward\.gate_proj\.weight$", "feed_forward.gate_up_weight", 0),
                  (r"feed_forward\.up_proj\.weight$", "feed_forward.gate_up_weight", 1),
                  (r"feed_forward\.gate_proj\.bias$", "feed_forward.gate_up_bias", 0),
                  (r"feed_forward\.up_proj\.bias$", "feed_forward.gate_up_bias", 1)]

# the Mamba2 mixer's tensors whose names differ from ours in every family
MIXER_RENAMES = [
    (r"\.conv1d\.weight$", ".conv_weight"),
    (r"\.conv1d\.bias$", ".conv_bias"),
    (r"\.norm\.weight$", ".norm_weight"),
]


class NameMapper:
    """checkpoint tensor name -> (our parameter name, index along its first dim or None); None
    for tensors the engine does not use. `renames` are (regex, replacement) applied in order,
    each at most once; `splits` map a regex to (replacement, index) for tensors that fill one
    slice of a stacked parameter (gate / up halves)."""

    def __init__(self, prefixes: tuple[str, ...], renames: list[tuple[str, str]],
                 splits: list[tuple[str, str, int]] = ()) -> None:
        self.prefixes = prefixes
        self.renames = [(re.compile(p), r) for p, r in renames]
        self.splits = [(re.compile(p), r, i) for p, r, i in splits]

    def __call__(self, name: str) -> tuple[str, int | None] | None:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        for pattern, repl, index in self.splits:
            if pattern.search(name):
                return pattern.sub(repl, name), index
        for pattern, repl in self.renames:
            name = pattern.sub(repl, name, count=1)
        return name, None
