"""Bamba (`BambaForCausalLM`, ibm-ai-platform Bamba-9B): Mamba2 or attention (partial RoPE) in
each layer, then a SwiGLU MLP; the shared hybrid decoder with Bamba's checkpoint names."""

from __future__ import annotations

from mambaserve.models.hybrid import MIXER_RENAMES, HybridForCausalLM, NameMapper


class BambaForCausalLM(HybridForCausalLM):
    pass


checkpoint_name_to_param = NameMapper(
    prefixes=("model.",),
    renames=MIXER_RENAMES,
    splits=[(r"feed_forward\.gate_proj\.weight$", "feed_forward.gate_up_weight", 0),
            (r"feed_forward\.up_proj\.weight$", "feed_forward.gate_up_weight", 1),
            (r"feed_forward\.gate_proj\.bias$", "feed_forward.gate_up_bias", 0),
            (r"feed_forward\.up_proj\.bias$", "feed_forward.gate_up_bias", 1)],
)
