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


# Source to put before a compile script: `sm90(k, sig, const, div, num_warps, num_stages)`
# compiles kernel `k` for sm_90 (its pointers and the arguments named in `div` marked multiples
# of 16, as the JIT specializes them), runs ptxas -v, and returns the PTX and the spill bytes per
# thread (stores + loads).
SM90 = r'''
import re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource


def sm90(k, sig, const, div, num_warps, num_stages=None):
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if n.endswith("_ptr") or n in div}
    opts = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages})}
    ptx = triton.compile(ASTSource(k, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                         options=opts).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o",
                              f.name + ".cubin"], capture_output=True, text=True, check=True)
    return ptx, sum(int(v) for v in re.findall(r"(\d+) bytes spill", out.stderr))
'''
