"""Set-up shared by the Triton kernel tests, imported before anything imports Triton: without
CUDA the kernels run on Triton's CPU interpreter, which has to be switched on before Triton's
first import (fp32/fp16 only there: the interpreter mishandles bf16 dots and casts); without
Triton the importing test module is skipped."""

from __future__ import annotations

import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
if DEV == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")


def require_interpreter(kernel) -> None:
    """On the CPU, skip the calling module when Triton was imported earlier without the
    interpreter (then `kernel` is a compiled kernel that needs a GPU)."""
    if DEV == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                    allow_module_level=True)


def decide_as_cuda(monkeypatch, module) -> list[str]:
    """On the CPU, `module`'s `kernel_path` decides as it would on CUDA (its launchers then run
    under the interpreter); returns the paths it decided, in order (empty on CUDA, where nothing
    is patched)."""
    from mambaserve.ops.dispatch import kernel_path

    decided: list[str] = []

    def decide(op, device, **inputs):
        decided.append(kernel_path(op, "cuda", **inputs))
        return decided[-1]

    if DEV == "cpu":
        monkeypatch.setattr(module, "kernel_path", decide)
    return decided
