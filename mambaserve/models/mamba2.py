"""Mamba2 (`Mamba2ForCausalLM`): a stack of Mamba2 mixers, each pre-norm and residual; the
shared hybrid decoder with Mamba2's checkpoint names (`backbone.` prefix; older checkpoints name
the embedding `embedding`). No attention layer, so the KV pool holds no memory."""

from __future__ import annotations

from mambaserve.models.hybrid import MIXER_RENAMES, HybridForCausalLM, NameMapper


class Mamba2ForCausalLM(HybridForCausalLM):
    pass


checkpoint_name_to_param = NameMapper(
    prefixes=("backbone.",),
    renames=[(r"^embeddings?\.weight$", "embed_tokens.weight"),
             (r"^layers\.(\d+)\.norm\.weight$", r"layers.\1.input_layernorm.weight"),
             (r"^layers\.(\d+)\.mixer\.", r"layers.\1.mamba."),
             (r"^norm_f\.weight$", "final_layernorm.weight"),
             *MIXER_RENAMES],
)
