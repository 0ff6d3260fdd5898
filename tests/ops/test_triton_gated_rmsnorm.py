"""Triton gated_rmsnorm (every variant) and gated_silu vs. the references (CPU interpreter
without CUDA; GPU with it)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.gated_rmsnorm import gated_rmsnorm_ref, gated_silu_ref
from mambaserve.ops.triton.gated_rmsnorm import (
    _gated_rmsnorm_kernel,
    gated_rmsnorm_triton,
    gated_silu_triton,
)

require_interpreter(_gated_rmsnorm_kernel)

# (norm_before_gate, weight_fp32): NemotronH / Bamba / Granite / Mamba2, and Falcon-H1's two
VARIANTS = [(False, False), (False, True), (True, True)]


def _inputs(T, Dm, dtype, w_dtype, strided_z, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(T, Dm, generator=gen).to(DEV, dtype)
    if strided_z:  # z is a split view of in_proj's output in the mixer
        z = torch.randn(T, 2 * Dm + 3, generator=gen).to(DEV, dtype)[:, 3: 3 + Dm]
    else:
        z = torch.randn(T, Dm, generator=gen).to(DEV, dtype)
    w = (1 + 0.3 * torch.randn(Dm, generator=gen)).to(DEV, w_dtype or dtype)
    return y, z, w


def _check(T, Dm, group_size, dtype, w_dtype=None, strided_z=False, seed=0, tol=None,
           variant=(False, False)):
    y, z, w = _inputs(T, Dm, dtype, w_dtype, strided_z, seed)
    ref = gated_rmsnorm_ref(y, z, w, group_size, 1e-5, *variant)
    out = gated_rmsnorm_triton(y, z, w, group_size, 1e-5, *variant)
    assert out.dtype == ref.dtype and not torch.isnan(out).any()
    tol = tol or (1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("Dm,gs", [(64, 16), (96, 48), (40, 40)])
def test_gated_rmsnorm_fp32(Dm, gs, variant):
    _check(5, Dm, gs, torch.float32, strided_z=True, seed=Dm + gs, variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gated_rmsnorm_fp16_with_fp32_weight(variant):
    """Falcon-H1's variants return y.dtype whatever the weight's; the default promotes."""
    _check(4, 64, 32, torch.float16, w_dtype=torch.float32, variant=variant)
    y, z, w = _inputs(2, 64, torch.float16, torch.float32, False, 1)
    want = torch.float32 if variant == (False, False) else torch.float16
    assert gated_rmsnorm_triton(y, z, w, 32, 1e-5, *variant).dtype == want


@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_falcon_variants_differ_from_the_default(variant):
    """The variants really are different computations (in fp16 the cast order shows; the norm
    position always does), so the tests above could not pass by running the default."""
    y, z, w = _inputs(6, 64, torch.float16, None, False, 2)
    default = gated_rmsnorm_ref(y, z, w, 16, 1e-5)
    out = gated_rmsnorm_triton(y, z, w, 16, 1e-5, *variant)
    assert not torch.equal(out, default)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Dm", [40, 96, 1500])
def test_gated_silu(Dm, dtype):
    gen = torch.Generator().manual_seed(Dm)
    y = torch.randn(7, Dm, generator=gen).to(DEV, dtype)
    z = (2 * torch.randn(7, 2 * Dm + 5, generator=gen)).to(DEV, dtype)[:, 5: 5 + Dm]
    out, ref = gated_silu_triton(y, z), gated_silu_ref(y, z)
    assert out.dtype == ref.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_empty_batches():
    y = torch.zeros(0, 32, device=DEV)
    w = torch.ones(32, device=DEV)
    assert gated_rmsnorm_triton(y, y, w, 16, 1e-5, True, True).shape == (0, 32)
    assert gated_silu_triton(y, y).shape == (0, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_rmsnorm_nemotron9b_bf16_gpu():
    _check(1000, 10240, 1280, torch.bfloat16, strided_z=True, tol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_gated_rmsnorm_falcon_h1_7b_bf16_gpu(variant):
    # Falcon-H1-7B (bench preset): mamba_d_ssm 3072, one group; bf16 weight
    _check(300, 3072, 3072, torch.bfloat16, strided_z=True, tol=1e-2, variant=variant)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_silu_bf16_gpu():
    gen = torch.Generator().manual_seed(0)
    y, z = (torch.randn(300, 3072, generator=gen).to(DEV, torch.bfloat16) for _ in range(2))
    torch.testing.assert_close(gated_silu_triton(y, z).float(), gated_silu_ref(y, z).float(),
                               rtol=1e-2, atol=1e-2)
