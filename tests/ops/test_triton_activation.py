"""Triton relu² vs. the reference (CPU interpreter without CUDA; compiled with it): bit-identical,
and the public op's dispatch."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.activation import relu2, relu2_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.activation import _relu2_kernel, relu2_triton

require_interpreter(_relu2_kernel)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, block", [((3, 37), 64), ((5, 128), 128), ((1,), 16), ((0, 8), 64)])
def test_relu2_kernel_is_bit_identical(dtype, shape, block):
    x = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(DEV, dtype)
    if x.numel():
        x.view(-1)[0] = -0.0
    with tuning.override("relu2", block=block, num_warps=2):
        y = relu2_triton(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.equal(y, relu2_ref(x))


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_relu2_at_the_9b_mlp_shape_on_gpu():
    x = torch.randn(2048, 15680, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(relu2(x), relu2_ref(x))  # default block and warps
    t = x[:, :100]  # not contiguous: the op falls back to the reference
    assert torch.equal(relu2(t), relu2_ref(t))


def test_relu2_dispatch_on_cpu_is_the_reference():
    x = torch.randn(4, 9)
    assert torch.equal(relu2(x), torch.relu(x).square())
