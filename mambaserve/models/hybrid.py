"""The decoder the hybrid families share (Falcon-H1, GraniteMoeHybrid, Bamba, Mamba2): each layer
is a mixer sub-block (a Mamba2 mixer, attention, or both in parallel, summed) and/or a
feed-forward sub-block, each pre-norm and residual, as described by `ModelConfig.layers`; the
family's multipliers apply where transformers applies them (docs/models.md). Flat token batches
in, logits of the rows `meta.logits_idx` selects out, like every model of the engine.

Module names are fixed here; each family module maps its checkpoint's tensor names onto them
(`NameMapper`): `embed_tokens`, `layers.{i}.input_layernorm`, `layers.{i}.mamba`,
`layers.{i}.self_attn`, `layers.{i}.pre_ff_layernorm`, `layers.{i}.feed_forward`,
`final_layernorm`, `lm_head`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.layers.attention import Attention
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.layers.mlp import MLP, GatedMLP
from mambaserve.layers.moe import MoE
from mambaserve.layers.norm import RMSNorm
from mambaserve.metadata import ForwardMetadata
from mambaserve.model_layout import FFNKind, LayerSpec
from mambaserve.ops.state_snapshot import restore_snapshots


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


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mamba_index = {i: n for n, i in enumerate(cfg.mamba_layer_ids)}
        self.attention_index = {i: n for n, i in enumerate(cfg.attention_layer_ids)}

    def tie_lm_head(self) -> None:
        """Share the embedding matrix as the output projection (checkpoints without lm_head)."""
        self.lm_head.weight = self.embed_tokens.weight

    def _norm(self, norm: RMSNorm, h: torch.Tensor, pending: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """h += pending (the previous sub-block's output), then norm(h): one pass when fused."""
        if pending is None:
            return norm(h.to(self.embed_tokens.weight.dtype)), h
        if self.cfg.residual_in_fp32:  # h float32; the norm sees it in the model dtype
            h = h + pending
            return norm(h.to(self.embed_tokens.weight.dtype)), h
        return norm(pending, h)

    def forward(self, meta: ForwardMetadata, conv_state: torch.Tensor | None,
                ssm_state: torch.Tensor | None, kv_cache: torch.Tensor | None) -> torch.Tensor:
        """Logits [len(meta.logits_idx), vocab] float32 (see NemotronHForCausalLM.forward)."""
        cfg = self.cfg
        if meta.prefill is not None and meta.prefill.num_restores:
            restore_snapshots(conv_state, ssm_state, meta.prefill.restore_src,
                              meta.prefill.restore_dst)
        h = self.embed_tokens(meta.input_ids)
        if cfg.embedding_multiplier != 1.0:
            h = h * cfg.embedding_multiplier
        if cfg.residual_in_fp32:
            h = h.float()
        pending = None  # the last sub-block's output, not yet added to h
        for i, layer in enumerate(self.layers):
            spec = layer.spec
            if spec.has_mixer:
                x, h = self._norm(layer.input_layernorm, h, pending)
                out = None
                if spec.mamba:
                    n = self.mamba_index[i]
                    xm = x * cfg.ssm_in_multiplier if cfg.ssm_in_multiplier != 1.0 else x
                    out = layer.mamba(xm, meta, conv_state[n], ssm_state[n])
                    if cfg.ssm_out_multiplier != 1.0:
                        out = out * cfg.ssm_out_multiplier
                if spec.attention:
                    xa = x * cfg.attention_in_multiplier \
                        if cfg.attention_in_multiplier != 1.0 else x
                    a = layer.self_attn(xa, meta, kv_cache[self.attention_index[i]])
                    if cfg.attention_out_multiplier != 1.0:
                        a = a * cfg.attention_out_multiplier
                    out = a if out is None else out + a
                pending = out * cfg.residual_multiplier if cfg.residual_multiplier != 1.0 \
                    else out
            if spec.ffn is not FFNKind.NONE:
                x, h = self._norm(layer.pre_ff_layernorm, h, pending)
                out = layer.feed_forward(x)
                pending = out * cfg.residual_multiplier if cfg.residual_multiplier != 1.0 \
                    else out
        # only the rows whose logits are needed take the last add and the final norm
        h = h.index_select(0, meta.logits_idx) + pending.index_select(0, meta.logits_idx)
        logits = self.lm_head(self.final_layernorm(h).to(self.lm_head.weight.dtype))
        if cfg.logits_multiplier != 1.0:
            logits = logits * cfg.logits_multiplier
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
