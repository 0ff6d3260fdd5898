"""Triton rotary embedding vs. the torch reference, with positions from a mixed batch built by
build_metadata (continued prefill rows, decode rows).

Without CUDA the kernel runs under Triton's CPU interpreter (float32 / float16); with CUDA the
same cases run on the GPU, plus a real shape in bf16.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.engine.batch import Batch, Row
from mambaserve.metadata import build_metadata
from mambaserve.ops.rotary import apply_rotary_ref, rotary_cos_sin
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.rotary import _rotary_kernel, apply_rotary_triton

require_interpreter(_rotary_kernel)


def _positions(prefills, decodes):
    def r(c, n):
        return Row.standalone(token_ids=[1] * n, context_len=c, state_slot=0, has_initial_state=c > 0,
                       pages=[0])
    plan = Batch(prefills=[r(c, n) for c, n in prefills], decodes=[r(c, 1) for c in decodes])
    return build_metadata(plan, chunk_size=8, conv_kernel=4, page_size=1 << 20, scratch_page=1,
                          device=DEV).positions


POS = ([(0, 6), (1000, 5), (37, 2)], [0, 15, 4095, 777])


def _run(H, Hkv, D, rotary_dim, neox, dtype, theta=10000.0, strided=False, seed=0, **knobs):
    g = torch.Generator().manual_seed(seed)
    pos = _positions(*POS)
    T = pos.shape[0]
    if strided:  # like a fused qkv projection: q and k are views of one buffer
        buf = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
        q = buf[:, : H * D].view(T, H, D)
        k = buf[:, H * D: (H + Hkv) * D].view(T, Hkv, D)
    else:
        q = torch.randn(T, H, D, generator=g).to(dtype).to(DEV)
        k = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    q0, k0 = q.clone(), k.clone()
    qr, kr = apply_rotary_ref(q, k, pos, theta, rotary_dim, neox)
    cos, sin = rotary_cos_sin(pos, theta, rotary_dim)  # the table the public op passes
    with tuning.override("rotary", **knobs):
        qt, kt = apply_rotary_triton(q, k, cos, sin, rotary_dim, neox)
    assert torch.equal(q, q0) and torch.equal(k, k0), "out-of-place: inputs untouched"
    assert qt.dtype == dtype and qt.shape == q.shape and kt.shape == k.shape
    return (qt, kt), (qr, kr)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("H,Hkv,D,rotary_dim", [(4, 2, 16, 16), (2, 1, 64, 32), (3, 3, 80, 80),
                                                (4, 1, 80, 40)])
def test_rotary_fp32(neox, H, Hkv, D, rotary_dim):
    got, ref = _run(H, Hkv, D, rotary_dim, neox, torch.float32, seed=D + H)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rotary_fp16_strided_head_blocks(neox):
    # 5 heads in blocks of 2 (a partial last block), pass-through channels in two 64-wide blocks
    got, ref = _run(5, 2, 160, 32, neox, torch.float16, theta=1e6, strided=True, seed=3,
                    block_h=2)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_rotary_bf16_gpu(neox):
    got, ref = _run(40, 8, 128, 128, neox, torch.bfloat16, theta=1e6, strided=True, seed=5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
