"""Architecture name -> model class. The config module validates the name first."""

from __future__ import annotations

from torch import nn

from mambaserve.config import ModelConfig
from mambaserve.models.nemotron_h import NemotronHForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {"NemotronHForCausalLM": NemotronHForCausalLM}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    return MODEL_CLASSES[cfg.architecture]
