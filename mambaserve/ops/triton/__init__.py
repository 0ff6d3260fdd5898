"""Triton kernels for the Mamba2 ops (one module per kernel).

Nothing here imports Triton at package import time: the public ops in `mambaserve.ops` call
`triton_available()` (a spec lookup, no import) and import a launcher lazily, only for CUDA
tensors. The package therefore imports on machines without Triton.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the `triton` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


__all__ = ["triton_available"]
