"""Triton sparse experts vs. the dense reference (CPU interpreter without CUDA; compiled with
it): many experts, top-k 1..8, tokens piled on one expert, experts with no token, batch sizes
1..512, both activations, float32 and model-dtype routing weights, block sizes that leave
partial tiles."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

from mambaserve.ops.moe_experts import moe_experts, moe_experts_loop, moe_experts_ref
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.moe_experts import (
    _moe_in_kernel,
    launch_params,
    moe_experts_triton,
    tma_compatible,
)

require_interpreter(_moe_in_kernel)


def case(T, H, I, E, k, activation, seed, dtype=torch.float32, weights_dtype=torch.float32,
         pile=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    rows = 2 * I if activation == "swiglu" else I
    w_in = torch.randn(E, rows, H, generator=g) / H ** 0.5
    w_out = torch.randn(E, H, I, generator=g) / I ** 0.5
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    if pile:  # most tokens on expert 0, so others get nothing
        ids[:, 0] = 0
        ids[:, 1:] = torch.rand(T, E - 1, generator=g).argsort(dim=1)[:, : k - 1] + 1
    w = torch.rand(T, k, generator=g)
    to = dict(device=DEV)
    return (x.to(dtype=dtype, **to), w_in.to(dtype=dtype, **to), w_out.to(dtype=dtype, **to),
            ids.to(**to), w.to(dtype=weights_dtype, **to))


# (T, H, I, E, k, pile): decode-like (a few tokens over many experts), top-k 1..8, a pile-up
SHAPES = [(1, 32, 16, 64, 6, False), (3, 48, 24, 8, 1, False), (7, 32, 40, 16, 8, True),
          (64, 32, 16, 4, 2, True), (130, 24, 16, 12, 3, False)]


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("T,H,I,E,k,pile", SHAPES)
def test_kernel_matches_the_dense_reference(activation, T, H, I, E, k, pile):
    args = case(T, H, I, E, k, activation, seed=T + k, pile=pile)
    with tuning.override("moe_experts", block_n_in=16, block_k_in=16, block_n_out=16,
                         block_k_out=32):
        got = moe_experts_triton(*args, activation)
    torch.testing.assert_close(got, moe_experts_ref(*args, activation), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_every_block_size_gives_the_same_result(block_m):
    args = case(40, 32, 16, 6, 2, "relu2", seed=5, pile=True)
    with tuning.override("moe_experts", block_m=block_m, block_n_in=32, block_k_in=32,
                         block_n_out=32, block_k_out=16):
        got = moe_experts_triton(*args, "relu2")
    torch.testing.assert_close(got, moe_experts_ref(*args, "relu2"), rtol=1e-5, atol=1e-5)


def test_512_tokens_top8():
    args = case(512, 16, 16, 32, 8, "swiglu", seed=9)
    with tuning.override("moe_experts", block_n_in=16, block_k_in=16, block_n_out=16,
                         block_k_out=16):
        got = moe_experts_triton(*args, "swiglu")
    torch.testing.assert_close(got, moe_experts_ref(*args, "swiglu"), rtol=1e-5, atol=1e-5)


def test_model_dtype_weights_round_the_product_in_fp16():
    args = case(20, 32, 16, 8, 2, "swiglu", seed=2, dtype=torch.float16,
                weights_dtype=torch.float16)
    with tuning.override("moe_experts", block_n_in=16, block_k_in=16, block_n_out=16,
                         block_k_out=16):
        got = moe_experts_triton(*args, "swiglu")
    torch.testing.assert_close(got, moe_experts_loop(*args, "swiglu"), rtol=2e-3, atol=2e-3)


def test_no_tokens():
    args = case(1, 16, 16, 4, 2, "relu2", seed=0)
    empty = (args[0][:0], args[1], args[2], args[3][:0], args[4][:0])
    assert moe_experts_triton(*empty, "relu2").shape == (0, 16)


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("activation,E,k,H,I", [("relu2", 128, 6, 2688, 1856),
                                                ("swiglu", 72, 10, 4096, 768)])
@pytest.mark.parametrize("T", [1, 8, 64, 512, 2048])
def test_bf16_at_the_published_shapes_on_gpu(activation, E, k, H, I, T):
    args = case(T, H, I, E, k, activation, seed=T, dtype=torch.bfloat16,
                weights_dtype=torch.float32 if activation == "relu2" else torch.bfloat16)
    got = moe_experts(*args, activation)  # the public op takes the kernel on CUDA
    ref = moe_experts_ref(*args, activation)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


# padding rows of inter (never stored) hold whatever the buffer held: numpy warns on their math
# (invalid value / overflow in matmul, add, multiply, cast); the real rows are compared below
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("T,H,I,E,k,block_m", [(40, 32, 24, 6, 2, 64), (130, 48, 40, 12, 3, 128),
                                               (9, 64, 16, 4, 4, 64)])
def test_tma_loads_give_the_pointer_loads_result(activation, T, H, I, E, k, block_m):
    """The prefill launch (weight tiles, and the out GEMM's rows of inter, through TMA
    descriptors) against the pointer loads, bit for bit: column tiles that run past an expert's
    rows (I and H not multiples of the tile) and K steps past the row's end. fp16: the
    interpreter's float32 dots sum in an order that depends on the operand's layout."""
    args = case(T, H, I, E, k, activation, seed=T + I, dtype=torch.float16)
    tiles = dict(block_m=block_m, block_n_in=16, block_k_in=32, block_n_out=32, block_k_out=16)
    with tuning.override("moe_experts", tma=False, **tiles):
        want = moe_experts_triton(*args, activation)
    with tuning.override("moe_experts", tma=True, **tiles):
        got = moe_experts_triton(*args, activation)
    assert torch.equal(got, want)
    torch.testing.assert_close(got, moe_experts_loop(*args, activation), rtol=2e-3, atol=2e-3)


def test_launch_rules_by_block_size_and_dtype():
    cfg = tuning.config("moe_experts", "cpu")
    small, large = launch_params(cfg, 16, 2, True), launch_params(cfg, 128, 2, True)
    assert (small["block_n_in"], small["num_warps_in"], small["tma"]) == (64, 4, False)
    assert (small["block_k_in"], small["block_k_out"]) == (128, 128)  # decode: 128-wide K steps
    assert (large["block_k_in"], large["block_k_out"]) == (64, 64)
    assert launch_params(cfg, 16, 4, True)["block_k_in"] == 64  # float32's shared memory
    assert (large["block_n_in"], large["block_n_out"], large["num_warps_out"]) == (128, 256, 8)
    assert large["tma"] is True and launch_params(cfg, 128, 2, False)["tma"] is False
    fp32 = launch_params(cfg, 128, 4, True)  # float32: the small tiles, no TMA
    assert (fp32["block_n_in"], fp32["block_n_out"], fp32["tma"]) == (64, 64, False)
    with tuning.override("moe_experts", block_n_out=32, tma=True):
        forced = launch_params(tuning.config("moe_experts", "cpu"), 16, 4, False)
    assert (forced["block_n_out"], forced["tma"]) == (32, True)


def test_unaligned_rows_fall_back_to_pointer_loads():
    """fp16 rows of 20 elements (40 bytes) cannot be TMA-described: the launch takes the pointer
    loads even when TMA is asked for, and the result still matches."""
    args = case(24, 32, 20, 4, 2, "swiglu", seed=3, dtype=torch.float16,
                weights_dtype=torch.float16)
    assert not tma_compatible(args[2])
    with tuning.override("moe_experts", block_m=64, block_n_in=16, block_k_in=16,
                         block_n_out=16, block_k_out=16, tma=True):
        got = moe_experts_triton(*args, "swiglu")
    torch.testing.assert_close(got, moe_experts_loop(*args, "swiglu"), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("activation,E,k,H,I", [("relu2", 128, 6, 2688, 1856),
                                                ("swiglu", 72, 10, 4096, 768)])
def test_prefill_launch_tma_equals_pointer_loads_on_gpu(activation, E, k, H, I):
    """bf16 at the published shapes, 2048 tokens (128-row blocks): the TMA launch the rules pick
    on sm_90+ gives the pointer launch's result bit for bit."""
    args = case(2048, H, I, E, k, activation, seed=1, dtype=torch.bfloat16,
                weights_dtype=torch.float32 if activation == "relu2" else torch.bfloat16)
    with tuning.override("moe_experts", tma=False):
        want = moe_experts_triton(*args, activation)
    with tuning.override("moe_experts", tma=True):
        got = moe_experts_triton(*args, activation)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,weights_dtype", [(torch.float32, torch.float32),
                                                 (torch.float16, torch.float16)])
@pytest.mark.parametrize("T,H", [(1, 32), (37, 48)])
def test_the_sum_with_the_shared_output_added_is_torchs(T, H, dtype, weights_dtype):
    """add=shared: the k-sum rounded to shared's dtype plus shared, as torch computes
    `sum.to(dtype) + shared`, bit for bit (the sum itself from the same launch without add)."""
    args = case(T, H, 24, 6, 3, "swiglu", seed=T, dtype=dtype, weights_dtype=weights_dtype)
    shared = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(dtype=dtype,
                                                                              device=DEV)
    with tuning.override("moe_experts", block_n_in=16, block_k_in=16, block_n_out=16,
                         block_k_out=16, combine_block=64, combine_block_h=16):
        routed = moe_experts_triton(*args, "swiglu")
        got = moe_experts_triton(*args, "swiglu", add=shared)
    assert routed.dtype == torch.float32 and got.dtype == dtype
    assert torch.equal(got, routed.to(dtype) + shared)
    pair_sum = moe_experts_ref(*args, "swiglu")
    torch.testing.assert_close(routed, pair_sum, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(moe_experts(*args, "swiglu", add=shared),
                               pair_sum.to(dtype) + shared, rtol=2e-3, atol=2e-3)
