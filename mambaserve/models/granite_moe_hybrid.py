"""GraniteMoeHybrid (`GraniteMoeHybridForCausalLM`, ibm-granite granite-4.0-h-*): Mamba2 or NoPE
attention in each layer, then routed SwiGLU experts plus a shared SwiGLU MLP (the shared MLP
alone in the expert-less models); the shared hybrid decoder with Granite's checkpoint names.

The shared MLP (`shared_mlp.input_linear` [2S, H], gate first, and `output_linear`) is the whole
feed-forward block of an expert-less model (`feed_forward.*`, a GatedMLP) but the shared expert of
the MoE otherwise (`feed_forward.shared_experts.*`), so the name map depends on the config: the
loader asks `checkpoint_name_to_param.for_config(cfg)` (models/registry.py).
"""

from __future__ import annotations

from mambaserve.config import ModelConfig
from mambaserve.models.hybrid import MIXER_RENAMES, HybridForCausalLM, NameMapper


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    pass


def _renames(shared: str) -> list[tuple[str, str]]:
    """`shared`: our module path of the shared MLP inside a layer."""
    return [
        (r"^norm\.weight$", "final_layernorm.weight"),
        (r"\.post_attention_layernorm\.weight$", ".pre_ff_layernorm.weight"),
        (r"\.shared_mlp\.input_linear\.weight$", f".{shared}.gate_up_weight"),  # [2S,H] -> [2,S,H]
        (r"\.shared_mlp\.output_linear\.weight$", f".{shared}.down_proj.weight"),
        # the checkpoint's names, and transformers 5's in-memory ones (also loadable there)
        (r"\.block_sparse_moe\.router\.(layer\.)?weight$", ".feed_forward.router.weight"),
        (r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$",
         ".feed_forward.experts_gate_up"),
        (r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$",
         ".feed_forward.experts_down"),
        *MIXER_RENAMES,
    ]


class _GraniteNames(NameMapper):
    """The MoE models' map; `for_config` picks the expert-less one when the config has no
    experts."""

    def for_config(self, cfg: ModelConfig) -> NameMapper:
        return self if cfg.has_moe else _DENSE


checkpoint_name_to_param = _GraniteNames(prefixes=("model.",),
                                         renames=_renames("feed_forward.shared_experts"))
_DENSE = NameMapper(prefixes=("model.",), renames=_renames("feed_forward"))
