"""The Triton FP8 activation quantization (`ops/triton/fp8_quant.py`, with the MLP activations in
its pass) and the norms that write FP8 rows (`ops/triton/rmsnorm.py` QUANT, the whole-row gated
norm of `ops/triton/gated_rmsnorm.py`) against the torch
reference quantization, bit for bit: codes and scales (CPU interpreter without CUDA; compiled on a
GPU of compute capability >= 8.9)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.activation import silu_mul
from mambaserve.ops.fp8_matmul import Fp8Rows, quantize_fp8_ref
from mambaserve.ops.gated_rmsnorm import gated_rmsnorm
from mambaserve.ops.rmsnorm import rms_norm
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.fp8_quant import _quant_rows_kernel, launch_plan, quantize_fp8_triton
from mambaserve.ops.triton.gated_rmsnorm import gated_rmsnorm_fp8_triton, gated_rmsnorm_triton
from mambaserve.ops.triton.rmsnorm import rms_norm_triton

require_interpreter(_quant_rows_kernel)

if DEV == "cuda" and torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 conversions need compute capability >= 8.9", allow_module_level=True)

# the interpreter mishandles bf16 casts, so bf16 runs only compiled
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def _codes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _rows(M, K, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + 24, generator=gen) * 3
    x[:, 5] = 30.0  # a large element: the rest spreads over the e4m3 subnormals too
    if M > 1:
        x[1] = 0.0  # an all-zero row: scale 1e-12 / 448, every code 0
    x = x[:, 8: 8 + K] if strided else x[:, :K].contiguous()
    return x.to(DEV, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", [None, "relu2", "silu_mul"])
@pytest.mark.parametrize("M,K,max_tile,strided", [(3, 96, 16384, False), (2, 300, 16384, True),
                                                  (3, 300, 64, False), (1, 4480, 16384, False)])
def test_quantization_matches_the_reference_bit_for_bit(M, K, max_tile, strided, act, dtype):
    width = 2 * K if act == "silu_mul" else K
    x = _rows(M, width, dtype, seed=M * K + width, strided=strided)
    with tuning.override("fp8_quant", max_tile=max_tile):
        assert launch_plan(K, x.device)["one_tile"] == (max_tile >= K)
        q, s = quantize_fp8_triton(x, None, act)
    if act == "silu_mul" and DEV == "cuda":
        qr, sr = quantize_fp8_ref(silu_mul(x.contiguous()))
    else:
        qr, sr = quantize_fp8_ref(x, None, act)
    assert q.shape == (M, K) and q.dtype == torch.float8_e4m3fn and s.shape == (M, 1)
    assert torch.equal(s, sr)
    assert torch.equal(_codes(q), _codes(qr))


@pytest.mark.parametrize("max_tile", [16384, 64])
def test_static_scale(max_tile):
    x = _rows(3, 200, torch.float32, seed=7)
    scale = torch.tensor(0.05, device=DEV)
    with tuning.override("fp8_quant", max_tile=max_tile):
        q, s = quantize_fp8_triton(x, scale)
    qr, sr = quantize_fp8_ref(x, scale)
    assert torch.equal(s, sr) and torch.equal(_codes(q), _codes(qr))  # clamped at +-448 too


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("T,D", [(4, 72), (1, 4480)])
def test_rms_norm_writes_the_quantization_of_its_output(T, D, residual, dtype):
    """QUANT stores quantize(out) of the very row the plain kernel stores, and the same
    residual stream."""
    gen = torch.Generator().manual_seed(T + D)
    x = torch.randn(T, D, generator=gen).to(DEV, dtype)
    r = (3 * torch.randn(T, D, generator=gen)).to(DEV, dtype) if residual else None
    w = (1 + 0.3 * torch.randn(D, generator=gen)).to(DEV, dtype)
    plain = rms_norm_triton(x, w, 1e-5, r)
    fused = rms_norm_triton(x, w, 1e-5, r, quantize=True)
    (q, s), out = (fused[0], plain[0]) if residual else (fused, plain)
    if residual:
        assert torch.equal(fused[1], plain[1])
    qr, sr = quantize_fp8_ref(out)
    assert torch.equal(s, sr) and torch.equal(_codes(q), _codes(qr))


def test_public_rms_norm_returns_fp8_rows_on_every_path():
    """`rms_norm(..., quantize=True)`: Fp8Rows standing for the normalized rows, with the
    residual stream beside them; the CPU reference path gives the same structure."""
    gen = torch.Generator().manual_seed(3)
    x, r = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    w = torch.ones(64)
    for dev in {"cpu", DEV}:
        rows, s = rms_norm(x.to(dev), w.to(dev), 1e-5, r.to(dev), quantize=True)
        out, s_plain = rms_norm(x.to(dev), w.to(dev), 1e-5, r.to(dev))
        assert isinstance(rows, Fp8Rows) and rows.dtype == x.dtype and rows.shape == (3, 64)
        assert torch.equal(s, s_plain)
        qr, sr = quantize_fp8_ref(out)
        assert torch.equal(rows.scale, sr) and torch.equal(_codes(rows.q), _codes(qr))
        torch.testing.assert_close(rows.q.float() * rows.scale, out, rtol=0.07, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_before_gate,weight_fp32", [(False, False), (False, True),
                                                          (True, False)])
@pytest.mark.parametrize("T,G,group", [(3, 8, 40), (2, 3, 24), (1, 8, 1280)])
def test_gated_rmsnorm_writes_the_quantization_of_its_output(T, G, group, norm_before_gate,
                                                              weight_fp32, dtype):
    """The whole-row gated norm (every variant, groups and channels padded to powers of two)
    stores quantize(out) of the very values the per-group kernel stores."""
    gen = torch.Generator().manual_seed(T * G + group)
    y, z = (torch.randn(T, G * group, generator=gen).to(DEV, dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(G * group, generator=gen)).to(DEV, dtype)
    args = (y, z, w, group, 1e-5, norm_before_gate, weight_fp32)
    q, s, out_dtype = gated_rmsnorm_fp8_triton(*args)
    out = gated_rmsnorm_triton(*args)
    assert out_dtype == out.dtype
    qr, sr = quantize_fp8_ref(out)
    if dtype == torch.float32 and DEV == "cuda":
        # compiled, the whole-row and per-group kernels sum each group in different orders, and a
        # float32 output keeps that last-ulp difference: scales within 1 ulp, codes within 1 step
        torch.testing.assert_close(s, sr, rtol=2.0**-22, atol=0)
        step = (_codes(q).int() - _codes(qr).int()).abs()
        assert step.max() <= 1 and step.float().mean() < 0.01
    else:
        assert torch.equal(s, sr) and torch.equal(_codes(q), _codes(qr))


def test_public_gated_rmsnorm_returns_fp8_rows():
    gen = torch.Generator().manual_seed(5)
    y, z = torch.randn(2, 96, generator=gen), torch.randn(2, 96, generator=gen)
    w = torch.ones(96)
    for dev in {"cpu", DEV}:
        args = (y.to(dev), z.to(dev), w.to(dev), 32, 1e-5)
        rows = gated_rmsnorm(*args, quantize=True)
        out = gated_rmsnorm(*args)
        assert isinstance(rows, Fp8Rows) and rows.dtype == out.dtype
        qr, sr = quantize_fp8_ref(out)
        assert torch.equal(rows.scale, sr) and torch.equal(_codes(rows.q), _codes(qr))


@pytest.mark.parametrize("T", [2, 5])
def test_gated_rmsnorm_fp8_launches_by_row_count(monkeypatch, T):
    """On the Triton path a batch of up to `fp8_unfused_rows` rows takes the per-group norm and
    the quantization launch, more rows the whole-row launch: the same codes and scales."""
    from mambaserve.ops import gated_rmsnorm as op
    from mambaserve.ops.triton import gated_rmsnorm as kernels

    monkeypatch.setattr(op, "kernel_path", lambda *a, **k: "triton")  # on the CPU too
    whole_row = []
    real = kernels.gated_rmsnorm_fp8_triton
    monkeypatch.setattr(kernels, "gated_rmsnorm_fp8_triton",
                        lambda *a: whole_row.append(a) or real(*a))
    gen = torch.Generator().manual_seed(T)
    y, z = (torch.randn(T, 96, generator=gen).to(DEV) for _ in range(2))
    w = (1 + 0.3 * torch.randn(96, generator=gen)).to(DEV)
    with tuning.override("gated_rmsnorm", fp8_unfused_rows=4):
        rows = op.gated_rmsnorm(y, z, w, 32, 1e-5, quantize=True)
    assert len(whole_row) == (T > 4)
    qr, sr = quantize_fp8_ref(gated_rmsnorm_triton(y, z, w, 32, 1e-5))
    assert torch.equal(rows.scale, sr) and torch.equal(_codes(rows.q), _codes(qr))


@pytest.mark.skipif(DEV != "cuda", reason="the FP8 GEMM paths run on the GPU")
@pytest.mark.parametrize("M", [1, 8, 64])  # the few-rows kernel, and _scaled_mm above max_m
def test_gpu_fp8_linear_on_fp8_rows_equals_quantizing_inside(M):
    from mambaserve.ops.fp8_matmul import fp8_linear, quantize_rows, quantize_weight_fp8

    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 4480, device="cuda", generator=gen).to(torch.bfloat16)
    wq, ws = quantize_weight_fp8(torch.randn(1536, 4480, device="cuda", generator=gen) * 0.02)
    assert torch.equal(fp8_linear(quantize_rows(x), wq, ws), fp8_linear(x, wq, ws))
