"""mambaserve: a serving engine for hybrid Mamba2 language models."""

from mambaserve.engine.llm import LLM
from mambaserve.engine.outputs import CompletionOutput, RequestOutput
from mambaserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
