"""Per-family readers of a checkpoint's config.json: each turns the keys its family writes into
the fields of the one normalized `ModelConfig` (mambaserve/config.py). A reader returns a dict of
ModelConfig fields and imports nothing of the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mambaserve.hf_configs import bamba, falcon_h1, granite_moe_hybrid, mamba2, nemotron_h

READERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "NemotronHForCausalLM": nemotron_h.read,
    "BambaForCausalLM": bamba.read,
    # FalconH1ForCausalLM
    "FalconH1ForCausalLM": falcon_h1.read,
    # GraniteMoeHybridForCausalLM
    "GraniteMoeHybridForCausalLM": granite_moe_hybrid.read,
    "Mamba2ForCausalLM": mamba2.read,
}
# model_type -> architecture, for configs without an "architectures" list
MODEL_TYPES = {"nemotron_h": "NemotronHForCausalLM", "bamba": "BambaForCausalLM",
               "falcon_h1": "FalconH1ForCausalLM",
               "mamba2": "Mamba2ForCausalLM", "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
