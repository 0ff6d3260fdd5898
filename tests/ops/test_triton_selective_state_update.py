"""Triton selective_state_update vs. the reference.

On a machine without CUDA the kernel runs under Triton's CPU interpreter (TRITON_INTERPRET=1, set
before triton is first imported; kept to float32/float16 and small shapes). With CUDA the same
cases run compiled on the GPU, plus one case at the Nemotron-Nano-9B-v2 layer shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.selective_state_update import selective_state_update_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.selective_state_update import (
    _ssu_kernel,
    selective_state_update_triton,
)

require_interpreter(_ssu_kernel)


def _inputs(Bt, H, P, N, G, num_slots, dtype, state_dtype, gen, skip_rows=(), strided=False):
    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV)

    ssm_state = rnd(num_slots + 1, H, P, N).to(state_dtype)
    slots = torch.randperm(num_slots, generator=gen)[:Bt].to(torch.int32)
    for r in skip_rows:
        slots[r] = -1
    if strided:  # x/B/C as views into one wider buffer, like the mixer's split of xBC
        buf = rnd(Bt, H * P + 2 * G * N + 7).to(dtype)
        x = buf[:, : H * P].view(Bt, H, P)
        B = buf[:, H * P: H * P + G * N].view(Bt, G, N)
        C = buf[:, H * P + G * N: H * P + 2 * G * N].view(Bt, G, N)
    else:
        x = rnd(Bt, H, P).to(dtype)
        B = rnd(Bt, G, N).to(dtype)
        C = rnd(Bt, G, N).to(dtype)
    dt = rnd(Bt, H, scale=2.0).to(dtype)
    A = -torch.rand(H, generator=gen).to(DEV) * 4 - 0.1
    D = rnd(H)
    dt_bias = rnd(H, scale=0.5)
    return ssm_state, x, dt, A, B, C, D, dt_bias, slots.to(DEV)


def _check(Bt, H, P, N, G, dtype, state_dtype, dt_limit, skip_rows=(), strided=False, seed=0,
           tol=None, snap=False, **kw):
    """snap: every other row also writes its new state to a snapshot slot of its own (the others
    -1), as prefix caching's decode snapshots do."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * Bt + 3
    st, x, dt, A, B, C, D, dtb, slots = _inputs(Bt, H, P, N, G, num_slots, dtype, state_dtype, gen,
                                                 skip_rows, strided)
    dst = None
    if snap:  # slots no row lives in
        free = [s for s in range(num_slots) if s not in set(slots.tolist())]
        dst = torch.tensor([free[r] if r % 2 == 0 and r not in skip_rows else -1
                            for r in range(Bt)], device=DEV)
    st_ref = st.clone()
    y_ref = selective_state_update_ref(st_ref, x, dt, A, B, C, D, dtb, dt_limit, slots, dst)
    st_tri = st.clone()
    with tuning.override("selective_state_update", **kw):
        y = selective_state_update_triton(st_tri, x, dt, A, B, C, D, dtb, dt_limit, slots, dst)
    assert y.dtype == x.dtype and y.shape == x.shape
    valid = slots >= 0
    tol = tol or (1e-5 if dtype == torch.float32 else 2e-3)
    torch.testing.assert_close(y[valid].float(), y_ref[valid].float(), rtol=tol, atol=tol)
    # every real slot matches (skipped rows only touched the scratch slot in the reference)
    torch.testing.assert_close(st_tri[:-1].float(), st_ref[:-1].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(st_tri[-1], st[-1])  # the kernel never touches scratch
    assert not torch.isnan(y).any()


@pytest.mark.parametrize("H,P,N,G", [(4, 16, 16, 2), (6, 24, 32, 3), (2, 8, 20, 1)])
def test_ssu_fp32(H, P, N, G):
    _check(5, H, P, N, G, torch.float32, torch.float32, (0.0, float("inf")), skip_rows=(1,),
           seed=H * 100 + P)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float16])
def test_ssu_writes_decode_snapshots(state_dtype):
    """snap_dst: a row's new state lands in its snapshot slot too (what the live slot gets),
    rows without one (and skipped rows) write nowhere else; other slots untouched."""
    _check(5, 4, 24, 16, 2, torch.float32, state_dtype, (0.0, float("inf")), skip_rows=(2,),
           snap=True, block_p=16, tol=1e-3 if state_dtype == torch.float16 else None)
    st_dst = None  # one row, the snapshot's bytes equal the live slot's exactly
    gen = torch.Generator().manual_seed(3)
    st, x, dt, A, B, C, D, dtb, slots = _inputs(1, 2, 8, 16, 1, 4, torch.float32, state_dtype,
                                                 gen)
    st_dst = torch.tensor([(int(slots[0]) + 1) % 4], device=DEV)
    selective_state_update_triton(st, x, dt, A, B, C, D, dtb, (0.0, float("inf")), slots, st_dst)
    assert torch.equal(st[int(st_dst[0])], st[int(slots[0])])


def test_ssu_block_p_remainder_and_strided():
    _check(3, 4, 24, 16, 2, torch.float32, torch.float32, (0.01, 0.5), skip_rows=(0, 2),
           strided=True, block_p=16)


def test_ssu_fp16_inputs():
    _check(4, 4, 16, 16, 4, torch.float16, torch.float32, (0.0, float("inf")), skip_rows=(3,))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("Bt", [1, 64, 256])
def test_ssu_nemotron9b_bf16_gpu(Bt):
    # 128 heads x 80, state 128, 8 groups; x/B/C strided views like the mixer
    _check(Bt, 128, 80, 128, 8, torch.bfloat16, torch.float32, (0.0, float("inf")),
           skip_rows=(0,) if Bt > 1 else (), strided=True, tol=1e-2)
    _check(Bt, 128, 80, 128, 8, torch.bfloat16, torch.float32, (0.0, float("inf")),
           skip_rows=(0,) if Bt > 1 else (), strided=True, tol=1e-2, snap=True)
