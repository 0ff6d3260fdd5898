"""`ops.linear.linear_residual` (a block's residual add in its closing projection) against the sum
in float64: on cuBLAS / the CPU in place (the residual tensor is the result), within the bound
of torch's `proj(x) + r` in bfloat16; on the few-rows kernel into a new tensor, `linear(..., add=)`
bit for bit;
`residual_in_projections` picks the steps of more rows than that kernel takes; wrong residuals
are refused by name."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before anything imports triton

# isort: split
from mambaserve.ops.dispatch import kernel_path
from mambaserve.ops.linear import linear, linear_residual, residual_in_projections
from mambaserve.ops.triton import tuning

gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")


def _case(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    r = torch.randn(M, N, generator=g).to(DEV, dtype)
    return x, w, r


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 at each |value| of the float64 tensor t."""
    e = torch.floor(torch.log2(t.abs().clamp_min(1e-30)))
    return torch.exp2(e - 7)


def _bound(x, w, r, K):
    """What `proj(x) + r` in bfloat16 may be off the exact sum by: half a spacing at the product
    (rounded, or its accumulator's error before an epilogue add), half a spacing at the sum, and
    the float32 accumulation over K terms."""
    p = x.double() @ w.double().t()
    s = r.double().abs() + x.double().abs() @ w.double().abs().t()
    want = r.double() + p
    return want, 0.5 * _ulp(p) + 0.5 * _ulp(want) + K * 2.0 ** -24 * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, N, K", [(9, 48, 64), (40, 96, 200), (2, 3, 5)])
def test_sum_within_the_two_op_bound(dtype, M, N, K):
    x, w, r = _case(M, N, K, dtype)
    out = linear_residual(x, w, r.clone())
    assert out.shape == (M, N) and out.dtype == dtype
    if kernel_path("gemv", x.device, x=x, weight=w) == "triton":  # few rows on CUDA
        assert torch.equal(out, linear(x, w, add=r))
        return
    if dtype == torch.float32:
        want = r.double() + x.double() @ w.double().t()
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        return
    want, bound = _bound(x, w, r, K)
    assert ((out.double() - want).abs() <= 1.01 * bound).all()


def test_in_place_on_cublas_and_the_cpu():
    x, w, r = _case(12, 32, 48, torch.float32, seed=1)
    r0 = r.clone()
    out = linear_residual(x, w, r)
    assert out.data_ptr() == r.data_ptr()  # the caller's residual is the result
    torch.testing.assert_close(out, r0 + x @ w.t(), rtol=1e-6, atol=1e-5)
    # a non-contiguous residual is summed into a copy
    rt = r0.t().contiguous().t()
    out = linear_residual(x, w, rt)
    torch.testing.assert_close(out, r0 + x @ w.t(), rtol=1e-6, atol=1e-5)


def test_wrong_residual_is_refused():
    x, w, r = _case(12, 32, 48, torch.float32)
    with pytest.raises(ValueError, match=r"residual must be \(12, 32\)"):
        linear_residual(x, w, r[:, :16])
    with pytest.raises(ValueError, match="residual must be"):
        linear_residual(x, w, r.double())


def test_steps_above_the_few_rows_kernel_fold():
    max_m = tuning.config("gemv", torch.device(DEV))["max_m"]
    assert not residual_in_projections(1, torch.device(DEV))
    assert not residual_in_projections(max_m, torch.device(DEV))
    assert residual_in_projections(max_m + 1, torch.device(DEV))


@gpu
@pytest.mark.parametrize("M", [1, 8, 9, 2048])
def test_at_the_9b_out_proj_shape_on_gpu(M):
    x, w, r = _case(M, 4480, 10240, torch.bfloat16, seed=2)
    want, bound = _bound(x, w, r, 10240)
    out = linear_residual(x, w, r.clone())
    assert ((out.double() - want).abs() <= 1.01 * bound).all()
