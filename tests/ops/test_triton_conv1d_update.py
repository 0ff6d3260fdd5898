"""Triton causal_conv1d_update vs. the reference (CPU interpreter without CUDA; GPU with it)."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.conv1d import causal_conv1d_update_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.conv1d_update import (
    _conv_update_kernel,
    causal_conv1d_update_triton,
)

require_interpreter(_conv_update_kernel)


def _check(Bt, Dm, K, dtype, bias=True, activation=True, skip_rows=(), strided=False, seed=0,
           tol=None, snap=False, **kw):
    """snap: every other row also writes its new window to a snapshot slot of its own (the
    others -1), as prefix caching's decode snapshots do."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * Bt + 2
    state = torch.randn(num_slots + 1, K - 1, Dm, generator=gen).to(DEV, dtype)
    if strided:
        x = torch.randn(Bt, Dm + 40, generator=gen).to(DEV, dtype)[:, 13: 13 + Dm]
    else:
        x = torch.randn(Bt, Dm, generator=gen).to(DEV, dtype)
    w = (torch.randn(Dm, K, generator=gen) * 0.5).to(DEV, dtype)
    b = (torch.randn(Dm, generator=gen) * 0.5).to(DEV, dtype) if bias else None
    slots = torch.randperm(num_slots, generator=gen)[:Bt].to(torch.int32)
    for r in skip_rows:
        slots[r] = -1
    slots = slots.to(DEV)
    dst = None
    if snap:  # slots no row lives in
        free = [s for s in range(num_slots) if s not in set(slots.tolist())]
        dst = torch.tensor([free[r] if r % 2 == 0 and r not in skip_rows else -1
                            for r in range(Bt)], device=DEV)
    st_ref, st = state.clone(), state.clone()
    out_ref = causal_conv1d_update_ref(x, w, b, st_ref, slots, activation, dst)
    with tuning.override("conv1d_update", **kw):
        out = causal_conv1d_update_triton(x, w, b, st, slots, activation, dst)
    valid = slots >= 0
    tol = tol or (1e-5 if dtype == torch.float32 else 5e-3)
    assert out.dtype == x.dtype and not torch.isnan(out).any()
    if dtype == torch.bfloat16:
        # the reference rounds the conv sum, the bias add and silu to bf16 (einsum in the weight's
        # dtype); the kernel keeps float32 until the final cast, so single elements can differ by
        # a bf16 ulp or two: compare by relative norm
        o, r = out[valid].float(), out_ref[valid].float()
        assert ((o - r).norm() / r.norm()).item() < tol
    else:
        torch.testing.assert_close(out[valid].float(), out_ref[valid].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(st[:-1], st_ref[:-1])  # state shift is an exact copy
    torch.testing.assert_close(st[-1], state[-1])  # scratch untouched


@pytest.mark.parametrize("K", [2, 4])
def test_conv_update_fp32(K):
    _check(4, 300, K, torch.float32, skip_rows=(2,), seed=K)


def test_conv_update_nobias_noact_strided():
    _check(3, 96, 4, torch.float32, bias=False, activation=False, strided=True, skip_rows=(0,),
           block_d=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_update_writes_decode_snapshots(dtype):
    """snap_dst: a row's shifted window lands in its snapshot slot too (bit for bit the live
    one), rows without one (and skipped rows) write nowhere else; other slots untouched."""
    _check(5, 200, 4, dtype, skip_rows=(2,), snap=True, block_d=64)
    _check(1, 96, 2, dtype, snap=True)


def test_conv_update_fp16():
    _check(3, 128, 4, torch.float16, skip_rows=(1,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Bt", [1, 256])
def test_conv_update_nemotron9b_bf16_gpu(Bt):
    _check(Bt, 12288, 4, torch.bfloat16, strided=True, skip_rows=(0,) if Bt > 1 else (), tol=1e-2)
    _check(Bt, 12288, 4, torch.bfloat16, strided=True, skip_rows=(0,) if Bt > 1 else (), tol=1e-2,
           snap=True)
