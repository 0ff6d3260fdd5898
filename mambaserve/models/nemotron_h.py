"""NemotronH (hybrid Mamba2 / attention / MLP / MoE) for serving: flat token batches in,
logits of selected tokens out. Parameter names follow the HF checkpoint without its `backbone.`
prefix; `checkpoint_name_to_param` is the one place that maps checkpoint names to parameters."""

from __future__ import annotations

import re

import torch
from torch import nn

from mambaserve.config import LayerKind, ModelConfig
from mambaserve.layers.attention import Attention
from mambaserve.layers.fp8_linear import takes_fp8_rows
from mambaserve.layers.linear import Linear
from mambaserve.layers.mamba2_mixer import Mamba2Mixer
from mambaserve.layers.mlp import MLP
from mambaserve.layers.moe import MoE
from mambaserve.layers.norm import RMSNorm
from mambaserve.metadata import ForwardMetadata
from mambaserve.models.forward_head import ForwardHead
from mambaserve.models.output_rows import narrow, output_rows, tail_start
from mambaserve.ops.linear import residual_in_projections
from mambaserve.ops.state_snapshot import restore_snapshots


class Block(nn.Module):
    """Pre-norm residual block around one mixer of any kind."""

    def __init__(self, cfg: ModelConfig, kind: LayerKind) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if kind is LayerKind.MAMBA:
            self.mixer = Mamba2Mixer(cfg)
        elif kind is LayerKind.ATTENTION:
            self.mixer = Attention(cfg)
        elif kind is LayerKind.MLP:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        else:
            self.mixer = MoE(cfg)
        # the norm writes FP8 rows for the mixer (`NemotronHForCausalLM.route_fp8_inputs`)
        self.fp8_input = False

    @property
    def folds_residual(self) -> bool:
        """The mixer's closing projection adds the residual stream (`residual=`): Mamba's
        out_proj, attention's o_proj, the MLP's down or the MoE shared expert's, where plain."""
        return self.mixer.folds_residual


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, k) for k in cfg.layer_kinds)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # index of each Mamba / attention layer inside the state / KV pools
        self.mamba_index = {i: n for n, i in enumerate(cfg.mamba_layer_ids)}
        self.attention_index = {i: n for n, i in enumerate(cfg.attention_layer_ids)}
        # from this block on only the logits rows are computed (models/output_rows.py): the
        # last Mamba or attention block, whose output part takes them
        stateful = [k in (LayerKind.MAMBA, LayerKind.ATTENTION) for k in cfg.layer_kinds]
        self.tail_start = tail_start(stateful, stateful)

    def tie_lm_head(self) -> None:
        """Share the embedding matrix as the output projection (checkpoints without lm_head)."""
        self.lm_head.weight = self.embeddings.weight

    def route_fp8_inputs(self) -> None:
        """Once the weights are final: each block whose mixer's first projection is FP8 of
        dynamic scales gets its input from the norm as FP8 rows (ops/rmsnorm.py: quantized in
        the norm's pass instead of one of its own)."""
        for block in self.layers:
            block.fp8_input = takes_fp8_rows(block.mixer)

    @property
    def has_head(self) -> bool:
        """The first block is a Mamba mixer: its in_proj needs the token ids only
        (models/forward_head.py)."""
        return self.layers[0].kind is LayerKind.MAMBA

    def forward_head(self, input_ids: torch.Tensor) -> ForwardHead:
        """The embedding, the first block's norm and its in_proj (`has_head`)."""
        block = self.layers[0]
        h = self.embeddings(input_ids)
        x = block.norm(h, quantize=block.fp8_input)
        return ForwardHead(h, x, block.mixer.in_proj(x))

    def forward(self, meta: ForwardMetadata, conv_state: torch.Tensor | None,
                ssm_state: torch.Tensor | None, kv_cache: torch.Tensor | None,
                head: ForwardHead | None = None) -> torch.Tensor:
        """Runs every layer over the flat batch; returns the logits of the rows
        `meta.logits_idx` selects, [len(logits_idx), vocab] float32. `head`: `forward_head`
        of `meta.input_ids`, already computed (the forward goes on from it).

        conv_state: [L_mamba, slots + 1, K-1, conv_dim]; ssm_state: [L_mamba, slots + 1, H, P, N];
        kv_cache: [L_attn, 2, pages + 1, page_size, H_kv, head_dim].
        Prefix-cache restores run first (every layer's state in one copy); snapshots are saved
        inside the Mamba layers.
        """
        if meta.prefill is not None and meta.prefill.num_restores:
            restore_snapshots(conv_state, ssm_state, meta.prefill.restore_src,
                              meta.prefill.restore_dst)
        h = self.embeddings(meta.input_ids) if head is None else head.stream  # residual stream
        # prefill-sized steps: a block whose closing projection can add h in its epilogue
        # returns h + its output (`residual_in_projections`); the others leave the add to the
        # next norm's pass
        fold = residual_in_projections(h.shape[0], h.device)
        out = None  # the previous block's mixer output, not yet added to h
        # the tail on the logits rows alone (None: on every row; models/output_rows.py)
        rows = output_rows(meta.logits_idx, h.shape[0]) if self.tail_start is not None else None
        narrowed = False  # h (and out) hold the logits rows only
        for i, block in enumerate(self.layers):
            if narrowed and rows.shape[0] == 0:
                break  # no row's output is read (a prompt's middle chunk)
            if i == 0 and head is not None:
                x = head.normed
            elif out is None:
                x = block.norm(h, quantize=block.fp8_input)
            else:  # h = h + out; x = norm(h), in one pass (the same rounding as two torch ops)
                x, h = block.norm(out, h, quantize=block.fp8_input)
            res = h if fold and block.folds_residual else None
            # the tail's first block: its output part on the logits rows
            sel = rows if rows is not None and i == self.tail_start else None
            if sel is not None and res is not None:
                res = res.index_select(0, sel)
            if block.kind is LayerKind.MAMBA:
                n = self.mamba_index[i]
                zxbcdt = head.projected if i == 0 and head is not None else None
                out = block.mixer(x, meta, conv_state[n], ssm_state[n], zxbcdt=zxbcdt,
                                  residual=res, out_rows=sel)
            elif block.kind is LayerKind.ATTENTION:
                out = block.mixer(x, meta, kv_cache[self.attention_index[i]], residual=res,
                                  out_rows=sel)
            elif res is not None:  # MLP, MoE
                out = block.mixer(x, res)
            else:
                out = block.mixer(x)
            if sel is not None:  # the block's output holds the logits rows only
                h = h.index_select(0, sel) if res is None else h
                fold, narrowed = residual_in_projections(sel.shape[0], h.device), True
            if res is not None:  # out is the new stream
                h, out = out, None
        if not narrowed:  # only the rows whose logits are needed take the last add and the norm
            h, out = narrow(h, out, meta.logits_idx)
        if out is not None:
            h = h + out
        return self.lm_head(self.norm_f(h)).float()


# checkpoint name (without prefix) -> (parameter name, expert index or None, transform)
_RENAMES = [
    (re.compile(r"^layers\.(\d+)\.mixer\.conv1d\.weight$"), r"layers.\1.mixer.conv_weight"),
    (re.compile(r"^layers\.(\d+)\.mixer\.conv1d\.bias$"), r"layers.\1.mixer.conv_bias"),
    (re.compile(r"^layers\.(\d+)\.mixer\.norm\.weight$"), r"layers.\1.mixer.norm_weight"),
    (re.compile(r"^layers\.(\d+)\.mixer\.experts\.up_proj$"), r"layers.\1.mixer.experts_up"),
    (re.compile(r"^layers\.(\d+)\.mixer\.experts\.down_proj$"), r"layers.\1.mixer.experts_down"),
]
_EXPERT = re.compile(r"^layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.weight$")


def checkpoint_name_to_param(name: str) -> tuple[str, int | None] | None:
    """Map an HF checkpoint tensor name to (parameter name, expert index); None = not ours."""
    for prefix in ("backbone.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    m = _EXPERT.match(name)
    if m:
        return f"layers.{m.group(1)}.mixer.experts_{m.group(3)}", int(m.group(2))
    for pattern, repl in _RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name), None
    return name, None
