"""Bamba (`BambaForCausalLM`, ibm-ai-platform Bamba-9B): Mamba2 or attention (partial RoPE) in
each layer, then a SwiGLU MLP; the shared hybrid decoder with Bamba's checkpoint names."""

from __future__ import annotations

from mambaserve.models.hybrid import (
    GATE_UP_SPLITS,
    MIXER_RENAMES,
    HybridForCausalLM,
    NameMapper,
)


class BambaForCausalLM(HybridForCausalLM):
    pass


checkpoint_name_to_param = NameMapper(
    prefixes=("model.",),
    renames=MIXER_RENAMES,
    splits=GATE_UP_SPLITS,
)
