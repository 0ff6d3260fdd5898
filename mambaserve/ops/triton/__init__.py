"""Triton kernels for the ops of `mambaserve.ops` (one module per kernel, launch parameters in
`tuning`).

Nothing here imports Triton at package import time: `mambaserve.ops.dispatch` decides, with
`triton_available()` (a spec lookup, no import), whether a public op runs its kernel, and the op
imports the launcher lazily, only then. The package therefore imports on machines without
Triton. Modules here import nothing from mambaserve outside this package.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the `triton` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


__all__ = ["triton_available"]
