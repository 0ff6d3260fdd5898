"""Compiling Triton kernels for a Hopper (sm_90) on a host without a GPU, for tests that check
the generated PTX. The compile runs in a subprocess without the Triton interpreter, and this
module never imports Triton itself: a Triton imported before tests/ops/triton_env.py would leave
the test modules after the caller without the interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def skip_without_triton() -> None:
    """Skip the calling test module when Triton is not installed (without importing it)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no triton", allow_module_level=True)


def compile_report(script: str, what: str):
    """Run `script` (Python source that compiles kernels and prints one JSON line last) with the
    repo on the path and the interpreter off; returns that JSON. Skips when the host has no
    ptxas; fails on any other error or after 600 s."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling {what} for sm_90 took over 600 s")
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas for an offline sm_90 compile")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
