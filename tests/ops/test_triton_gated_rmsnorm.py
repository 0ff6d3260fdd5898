"""Triton gated_rmsnorm vs. the reference (CPU interpreter without CUDA; GPU with it)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.gated_rmsnorm import gated_rmsnorm_ref
from mambaserve.ops.triton.gated_rmsnorm import (
    _gated_rmsnorm_kernel,
    gated_rmsnorm_triton,
)

require_interpreter(_gated_rmsnorm_kernel)


def _check(T, Dm, group_size, dtype, w_dtype=None, strided_z=False, seed=0, tol=None):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(T, Dm, generator=gen).to(DEV, dtype)
    if strided_z:  # z is a split view of in_proj's output in the mixer
        z = torch.randn(T, 2 * Dm + 3, generator=gen).to(DEV, dtype)[:, 3: 3 + Dm]
    else:
        z = torch.randn(T, Dm, generator=gen).to(DEV, dtype)
    w = (1 + 0.3 * torch.randn(Dm, generator=gen)).to(DEV, w_dtype or dtype)
    ref = gated_rmsnorm_ref(y, z, w, group_size, 1e-5)
    out = gated_rmsnorm_triton(y, z, w, group_size, 1e-5)
    assert out.dtype == ref.dtype and not torch.isnan(out).any()
    tol = tol or (1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("Dm,gs", [(64, 16), (96, 48), (40, 40)])
def test_gated_rmsnorm_fp32(Dm, gs):
    _check(5, Dm, gs, torch.float32, strided_z=True, seed=Dm + gs)


def test_gated_rmsnorm_fp16_with_fp32_weight():
    _check(4, 64, 32, torch.float16, w_dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gated_rmsnorm_nemotron9b_bf16_gpu():
    _check(1000, 10240, 1280, torch.bfloat16, strided_z=True, tol=1e-2)
