"""Triton relu² and silu_mul vs. their references (CPU interpreter without CUDA; compiled with
it): relu² bit-identical, silu_mul within one ulp of the dtype; the public ops' dispatch."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.activation import relu2, relu2_ref, silu_mul, silu_mul_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.activation import _relu2_kernel, relu2_triton, silu_mul_triton

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


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the dtype's spacing at b (float32 math)."""
    spacing = torch.finfo(b.dtype).eps * b.float().abs().clamp_min(torch.finfo(b.dtype).tiny)
    return (a.float() - b.float()).abs() / spacing


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, block", [((3, 2 * 37), 16), ((5, 2 * 128), 64), ((1, 2), 16),
                                          ((0, 8), 16), ((2, 3, 2 * 20), 32)])
def test_silu_mul_kernel_matches_the_torch_expression(dtype, shape, block):
    """silu(gate) * up with both of torch's roundings; the kernel's exp may move an element by
    one ulp of the dtype. In float32 the exp itself differs: numpy's under the interpreter (2
    ulps), the GPU's fast ex2 approximation (2.6 ulps seen on an H200), hence 4."""
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).to(DEV, dtype)
    with tuning.override("silu_mul", block=block, num_warps=2):
        y = silu_mul_triton(x)
    want = silu_mul_ref(x)
    assert y.shape == want.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    if y.numel():
        assert _ulps_apart(y, want).max().item() <= (4.0 if dtype == torch.float32 else 2.0)


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
def test_silu_mul_at_the_falcon_mlp_shape_on_gpu():
    x = torch.randn(2048, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    y = silu_mul(x)  # default block and warps
    assert _ulps_apart(y, silu_mul_ref(x)).max().item() <= 1.0
    t = x[:, :200]  # not contiguous: the op falls back to the reference
    assert torch.equal(silu_mul(t), silu_mul_ref(t))


def test_silu_mul_dispatch_on_cpu_is_the_reference():
    x = torch.randn(4, 10)
    assert torch.equal(silu_mul(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])
