"""`ops.gemm_waves.column_split` (the closing projections' GEMM split at a wave boundary): its
rule on the shapes it was made for, off by default and off the GPU; and `linear_residual` with
the split on CUDA against the one GEMM."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV  # before anything imports triton

# isort: split
from mambaserve.ops.gemm_waves import column_split, split_columns
from mambaserve.ops.linear import linear_residual
from mambaserve.ops.triton import tuning


@pytest.mark.parametrize("M, N, tile_n, want", [
    (2048, 4480, 128, 33 * 128),  # 16 x 35 tiles: 4 waves of 132 and 32; 16 x 33 = 4 waves
    (2048, 4480, 256, 16 * 256),  # 16 x 18: 2 waves and 24; 264 // 16 = 16 columns
    (1024, 4480, 128, 33 * 128),  # 8 x 35 = 280: 2 waves and 16; 264 // 8 = 33
    (4096, 4480, 128, 0),         # 32 x 35 = 1120: 8 waves and 64 (more than a third: left)
    (2048, 22656, 128, 0),        # 16 x 177 = 2832: 21 waves and 60 (left)
    (100, 4480, 128, 0),          # 1 x 35: no full wave
    (128 * 132, 128, 128, 0),     # exactly one wave: no tail
])
def test_rule(M, N, tile_n, want):
    assert split_columns(M, N, 132, 0.34, 128, tile_n) == want


def test_off_by_default_and_off_the_gpu():
    assert tuning.DEFAULT["gemm_waves"]["split_tail"] == 0
    with tuning.override("gemm_waves", split_tail=0.34):
        assert column_split(2048, 4480, torch.device("cpu")) == 0


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("M, N, K", [(2048, 4480, 1024), (1024, 4480, 512)])
def test_split_matches_one_gemm_on_cuda(M, N, K):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, torch.bfloat16)
    r = torch.randn(M, N, generator=g).to(DEV, torch.bfloat16)
    one = linear_residual(x, w, r.clone())
    with tuning.override("gemm_waves", split_tail=1.0):
        assert column_split(M, N, x.device) > 0
        two = linear_residual(x, w, r.clone())
    # each column's dot products are cuBLAS's either way; kernels may order K differently
    torch.testing.assert_close(two.float(), one.float(), rtol=1.6e-2, atol=1e-2)
