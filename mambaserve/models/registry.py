"""Architecture name -> model class and checkpoint-name mapping. The config module validates the
name first (mambaserve/hf_configs/ lists the readable architectures)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.models import bamba, falcon_h1, granite_moe_hybrid, mamba2, nemotron_h

NameMap = Callable[[str], "tuple[str, int | None] | None"]

FAMILIES: dict[str, tuple[type[nn.Module], NameMap]] = {
    "NemotronHForCausalLM": (nemotron_h.NemotronHForCausalLM,
                             nemotron_h.checkpoint_name_to_param),
    "BambaForCausalLM": (bamba.BambaForCausalLM, bamba.checkpoint_name_to_param),
    "FalconH1ForCausalLM": (falcon_h1.FalconH1ForCausalLM,
                            falcon_h1.checkpoint_name_to_param),
    "Mamba2ForCausalLM": (mamba2.Mamba2ForCausalLM, mamba2.checkpoint_name_to_param),
    "GraniteMoeHybridForCausalLM": (granite_moe_hybrid.GraniteMoeHybridForCausalLM,
                                    granite_moe_hybrid.checkpoint_name_to_param),
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return FAMILIES[cfg.architecture][0]


def checkpoint_name_map(cfg: ModelConfig) -> NameMap:
    """checkpoint tensor name -> (parameter name, index along its first dim or None). A family
    whose names depend on the config (Granite: dense or MoE FFN) has a `for_config` picking one."""
    name_map = FAMILIES[cfg.architecture][1]
    return name_map.for_config(cfg) if hasattr(name_map, "for_config") else name_map
