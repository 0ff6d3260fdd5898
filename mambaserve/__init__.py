"""mambaserve: a serving engine for hybrid Mamba2 language models."""
