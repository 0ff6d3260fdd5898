"""What a model's decoder layers are made of, family-independent: the vocabulary the config
readers (mambaserve/hf_configs/) and the models share.

A decoder layer has up to two pre-norm residual sub-blocks:
- a token mixer: a Mamba2 mixer, an attention layer, or both run in parallel on the same normed
  input and summed (Falcon-H1);
- a feed-forward block (`FFNKind`).
NemotronH layers hold exactly one of the two (its "M", "*", "-", "E" pattern characters), the other
hybrid families both. Which layers hold Mamba state (a state-pool slot per request) and which hold
a KV cache follows from `LayerSpec.mamba` / `LayerSpec.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class LayerKind(str, Enum):
    """NemotronH's one-block layers (its hybrid_override_pattern / layers_block_type)."""

    MAMBA = "mamba"
    ATTENTION = "attention"
    MLP = "mlp"
    MOE = "moe"


class FFNKind(str, Enum):
    NONE = "none"
    RELU2 = "relu2"  # up -> relu^2 -> down (NemotronH)
    SWIGLU = "swiglu"  # down(silu(gate) * up) (Falcon-H1, Bamba, Granite's shared MLP)
    MOE = "moe"  # routed experts plus a shared expert / MLP (router kind on the config)


@dataclass(frozen=True)
class LayerSpec:
    mamba: bool = False  # the mixer sub-block has a Mamba2 mixer (holds conv + SSM state)
    attention: bool = False  # the mixer sub-block has attention (holds KV cache pages)
    ffn: FFNKind = FFNKind.NONE

    @property
    def has_mixer(self) -> bool:
        return self.mamba or self.attention

    @classmethod
    def of_kind(cls, kind: LayerKind, moe_is_ffn: bool = True) -> LayerSpec:
        """The spec of a NemotronH one-block layer."""
        return {LayerKind.MAMBA: cls(mamba=True), LayerKind.ATTENTION: cls(attention=True),
                LayerKind.MLP: cls(ffn=FFNKind.RELU2), LayerKind.MOE: cls(ffn=FFNKind.MOE)}[kind]
