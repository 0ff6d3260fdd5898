"""The one-launch Mamba2 decode step (`ops/triton/mamba_decode_step.py`: conv step + state
update) against the conv kernel followed by the state-update kernel, bit for bit: y, both pools
and the arrival counters left at zero (CPU interpreter without CUDA, fp32 / fp16; compiled on a
GPU, bf16 and the 9B shape too, only with MAMBASERVE_FUSED_DECODE_STEP=1: compiled, the launch is
wrong, docs/kernels.md "Known limits"). The public op's paths against the two references."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.dispatch import fused_decode_step_enabled
from mambaserve.ops.mamba_decode_step import conv_state_step, conv_state_step_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.conv1d_update import causal_conv1d_update_triton
from mambaserve.ops.triton.gemv import column_counters
from mambaserve.ops.triton.mamba_decode_step import (
    _conv_state_step_kernel,
    conv_state_step_triton,
)
from mambaserve.ops.triton.selective_state_update import selective_state_update_triton

require_interpreter(_conv_state_step_kernel)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
# compiled, the one launch differs from the two kernels (docs/kernels.md, "Known limits"): its
# GPU cases run when it is opted into, and then show it
opted_in_on_gpu = pytest.mark.skipif(
    DEV == "cuda" and not fused_decode_step_enabled(),
    reason="the one-launch decode step is off on the GPU (MAMBASERVE_FUSED_DECODE_STEP=1)")


def _case(Bt, H, P, N, G, K, dtype, bias, seed, skip_rows=(), slots_total=6):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV)

    conv_dim = H * P + 2 * G * N
    xbc = rnd(Bt, conv_dim + 5).to(dtype)[:, 2: 2 + conv_dim]  # strided rows, as in_proj's split
    weight = rnd(conv_dim, K, scale=0.5).to(dtype)
    b = rnd(conv_dim, scale=0.1).to(dtype) if bias else None
    conv_state = rnd(slots_total + 1, K - 1, conv_dim).to(dtype)
    ssm_state = rnd(slots_total + 1, H, P, N)
    slots = torch.randperm(slots_total, generator=gen)[:Bt].to(torch.int32)
    for r in skip_rows:
        slots[r] = -1
    dt = rnd(Bt, H, scale=2.0).to(dtype)
    A = -torch.rand(H, generator=gen).to(DEV) * 4 - 0.1
    D, dt_bias = rnd(H), rnd(H, scale=0.5)
    return xbc, weight, b, conv_state, ssm_state, dt, A, D, dt_bias, slots.to(DEV)


def _two_kernels(xbc, weight, b, conv_state, ssm_state, dt, A, D, dt_bias, slots, G, limit):
    Bt = xbc.shape[0]
    _, H, P, N = ssm_state.shape
    xc = causal_conv1d_update_triton(xbc, weight, b, conv_state, slots)
    xs, B, C = xc.split([H * P, G * N, G * N], dim=-1)
    return selective_state_update_triton(ssm_state, xs.reshape(Bt, H, P), dt, A,
                                         B.reshape(Bt, G, N), C.reshape(Bt, G, N), D, dt_bias,
                                         limit, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("Bt,H,P,N,G,K,bias,skip,block_p", [
    (3, 4, 8, 16, 2, 4, True, (), None),      # two groups, two heads each
    (2, 6, 12, 20, 3, 3, False, (1,), 4),     # P, N not powers of two; a skipped row; 3 p-blocks
    (4, 2, 16, 8, 1, 2, True, (0, 3), None),  # one group, K = 2 (no window shift inside)
    (1, 8, 4, 32, 8, 4, True, (), 2),         # a group per head
])
@opted_in_on_gpu
def test_one_launch_equals_the_two_kernels(Bt, H, P, N, G, K, bias, skip, block_p, dtype):
    limit = (0.0, 8.0)
    case = _case(Bt, H, P, N, G, K, dtype, bias, seed=Bt * H + K, skip_rows=skip)
    xbc, weight, b, conv_state, ssm_state, dt, A, D, dt_bias, slots = case
    c1, s1 = conv_state.clone(), ssm_state.clone()
    c2, s2 = conv_state.clone(), ssm_state.clone()
    with tuning.override("selective_state_update", block_p=block_p):
        want = _two_kernels(xbc, weight, b, c1, s1, dt, A, D, dt_bias, slots, G, limit)
        got = conv_state_step_triton(xbc, weight, b, c2, s2, dt, A, D, dt_bias, limit, slots, G)
    assert torch.equal(got, want)
    assert torch.equal(c2, c1) and torch.equal(s2, s1)
    assert not torch.equal(c2, conv_state)  # the windows did move
    assert int(column_counters(xbc.device).abs().sum()) == 0
    for r in skip:
        assert not got[r].any()


def test_public_op_paths_agree():
    """Whichever path `conv_state_step` takes (the Triton launch on CUDA, the two references
    on the CPU) computes the two ops in turn."""
    limit = (0.0, float("inf"))
    case = _case(2, 4, 8, 16, 2, 4, torch.float32, True, seed=9, skip_rows=(1,))
    xbc, weight, b, conv_state, ssm_state, dt, A, D, dt_bias, slots = case
    c1, s1, c2, s2 = conv_state.clone(), ssm_state.clone(), conv_state.clone(), ssm_state.clone()
    want = conv_state_step_ref(xbc, weight, b, c1, s1, dt, A, D, dt_bias, limit, slots, 2)
    got = conv_state_step(xbc, weight, b, c2, s2, dt, A, D, dt_bias, limit, slots, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c2, c1, rtol=0, atol=0)
    torch.testing.assert_close(s2, s1, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="the 9B layer shape, compiled")
@opted_in_on_gpu
def test_gpu_9b_shape_bf16():
    limit = (0.0, float("inf"))
    case = _case(8, 128, 64, 128, 8, 4, torch.bfloat16, True, seed=1, skip_rows=(5,),
                 slots_total=16)
    xbc, weight, b, conv_state, ssm_state, dt, A, D, dt_bias, slots = case
    c1, s1, c2, s2 = conv_state.clone(), ssm_state.clone(), conv_state.clone(), ssm_state.clone()
    want = _two_kernels(xbc, weight, b, c1, s1, dt, A, D, dt_bias, slots, 8, limit)
    got = conv_state_step_triton(xbc, weight, b, c2, s2, dt, A, D, dt_bias, limit, slots, 8)
    assert torch.equal(got, want) and torch.equal(c2, c1) and torch.equal(s2, s1)
