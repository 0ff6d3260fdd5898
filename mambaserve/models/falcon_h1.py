"""Falcon-H1 (`FalconH1ForCausalLM`, tiiuae Falcon-H1 / Falcon-H1R): attention and a Mamba2
mixer in parallel in every layer (both caches in every layer), then a SwiGLU MLP; the shared
hybrid decoder with Falcon's checkpoint names and its gated norm, which multiplies by the norm
weight in float32 before the one cast back (FalconH1RMSNormGated), in both gate orders."""

from __future__ import annotations

from mambaserve.models.hybrid import (
    GATE_UP_SPLITS,
    MIXER_RENAMES,
    HybridForCausalLM,
    NameMapper,
)


class FalconH1ForCausalLM(HybridForCausalLM):
    """The gated norm's float32 weight multiply comes from the config
    (`ModelConfig.mamba_norm_weight_fp32`, set by the Falcon-H1 reader)."""


checkpoint_name_to_param = NameMapper(
    prefixes=("model.",),
    renames=MIXER_RENAMES,
    splits=GATE_UP_SPLITS,
)
