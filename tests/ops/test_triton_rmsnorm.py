"""Triton rms_norm (with and without the fused residual add) vs. the reference (CPU interpreter
without CUDA; GPU with it), plus the public op's dispatch and lazy Triton import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.layers.norm import RMSNorm
from mambaserve.ops.rmsnorm import rms_norm, rms_norm_ref
from mambaserve.ops.triton.rmsnorm import _rms_norm_kernel, rms_norm_triton

require_interpreter(_rms_norm_kernel)

# the interpreter mishandles bf16, so bf16 runs only compiled
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
EPS = 1e-5


def _inputs(T, D, dtype, strided=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # a column slice of a wider buffer: rows strided, last dim contiguous
        x = torch.randn(T, D + 40, generator=gen).to(DEV, dtype)[:, 24: 24 + D]
        r = (3 * torch.randn(T, 2 * D + 8, generator=gen)).to(DEV, dtype)[:, D + 8:]
    else:
        x = torch.randn(T, D, generator=gen).to(DEV, dtype)
        r = (3 * torch.randn(T, D, generator=gen)).to(DEV, dtype)
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    return x, r, w


def _check(T, D, dtype, residual, strided=False, seed=0, tol=None):
    x, r, w = _inputs(T, D, dtype, strided, seed)
    if tol is None:
        tol = 1e-5 if dtype in (torch.float32, torch.float64) else 1e-3 if dtype == torch.float16 else 1e-2
    if residual:
        ref, ref_s = rms_norm_ref(x, w, EPS, r)
        out, s = rms_norm_triton(x, w, EPS, r)
        assert s.shape == (T, D) and s.dtype == dtype
        assert torch.equal(s, ref_s)  # the residual stream must not drift from the reference's
    else:
        ref = rms_norm_ref(x, w, EPS)
        out = rms_norm_triton(x, w, EPS)
    assert out.shape == (T, D) and out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("T,D,strided", [(5, 72, False), (6, 72, True), (4, 128, True),
                                         (1, 72, False), (1, 4480, True), (3, 4480, False)])
def test_matches_reference(T, D, strided, residual, dtype):
    _check(T, D, dtype, residual, strided, seed=T * D + residual)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []),
                         ids=str)
def test_float32_residual_stream(dtype):
    """A float32 residual beside a half-precision x (Mamba2's residual_in_fp32): s = r + x stays
    float32, bit-identical to torch's add, and the norm is the unfused norm((r + x).to(dtype)),
    on the reference and the kernel."""
    x, _, w = _inputs(5, 72, dtype, seed=3)
    r = 3 * torch.randn(5, 72, generator=torch.Generator().manual_seed(4)).to(DEV)
    want_s = r + x
    want = rms_norm_ref(want_s.to(dtype), w, EPS)
    ref, ref_s = rms_norm_ref(x, w, EPS, r)
    out, s = rms_norm_triton(x, w, EPS, r)
    assert s.dtype == ref_s.dtype == torch.float32 and out.dtype == ref.dtype == dtype
    assert torch.equal(ref_s, want_s) and torch.equal(s, want_s)
    assert torch.equal(ref, want)
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-3, atol=1e-3)


def test_fp64_residual_added_natively():
    _check(4, 72, torch.float64, residual=True, strided=True)


@pytest.mark.parametrize("residual", [False, True])
def test_zero_tokens(residual):
    x, r, w = _inputs(0, 72, torch.float32)
    res = rms_norm_triton(x, w, EPS, r if residual else None)
    for t in res if residual else (res,):
        assert t.shape == (0, 72) and t.dtype == torch.float32


def test_weight_dtype_differs_from_x():
    """fp16 activations with an fp32 weight: the multiply is fp32 and the output stays fp16."""
    x, r, _ = _inputs(3, 72, torch.float16)
    w = (1 + 0.3 * torch.randn(72, generator=torch.Generator().manual_seed(1))).to(DEV)
    ref, ref_s = rms_norm_ref(x, w, EPS, r)
    out, s = rms_norm_triton(x, w, EPS, r)
    assert out.dtype == torch.float16 and torch.equal(s, ref_s)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-3, atol=1e-3)


def test_reference_is_the_module_and_dispatch_on_cpu():
    """The reference is bit-identical to RMSNorm.forward (fused: to the unfused add + module),
    and the public op on CPU tensors is the reference."""
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(7, 96, generator=gen).to(dtype)
        r = torch.randn(7, 96, generator=gen).to(dtype)
        norm = RMSNorm(96, EPS)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
            w = norm.weight.detach()
            assert torch.equal(rms_norm_ref(x, w, EPS), norm(x))
            ref, ref_s = rms_norm_ref(x, w, EPS, r)
            assert torch.equal(ref_s, r + x) and torch.equal(ref, norm(r + x))
            assert torch.equal(rms_norm(x, w, EPS), norm(x))
            out, s = rms_norm(x, w, EPS, r)
            assert torch.equal(out, ref) and torch.equal(s, ref_s)


def test_import_and_cpu_call_do_not_import_triton():
    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys, torch\n"
        "from mambaserve.ops.rmsnorm import rms_norm\n"
        "x = torch.randn(2, 8)\n"
        "rms_norm(x, torch.ones(8), 1e-5, x)\n"
        "bad = [m for m in sys.modules if m == 'triton' or m.startswith('triton.')]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("residual", [False, True])
def test_nemotron_h_bf16_gpu(residual):
    """Nemotron-H hidden size at a prefill-sized batch: out within 1e-2 relative of the reference
    (elementwise and in norm), the residual stream bit-identical (checked in _check)."""
    out, ref = _check(4096, 4480, torch.bfloat16, residual, strided=True, tol=1e-2)
    rel = (out.float() - ref.float()).norm() / ref.float().norm()
    assert rel < 1e-2, rel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_and_graph_capture():
    """The public op takes the Triton path on CUDA and replays inside a CUDA graph (no host sync)."""
    x, r, w = _inputs(64, 4480, torch.bfloat16)
    rms_norm(x, w, EPS, r)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_s = rms_norm(x, w, EPS, r)
    x.copy_(torch.randn_like(x))
    g.replay()
    ref, ref_s = rms_norm_ref(x, w, EPS, r)
    assert torch.equal(g_s, ref_s)
    torch.testing.assert_close(g_out.float(), ref.float(), rtol=1e-2, atol=1e-2)
