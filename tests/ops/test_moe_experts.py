"""The MoE experts op's reference (dense, sync-free) against a per-token loop and the per-expert
gather loop; the block layout of the sparse path (`align_pairs`) checked for every routing shape
(pure torch, runs anywhere)."""

import pytest
import torch
import torch.nn.functional as F

from mambaserve.ops.moe_experts import (
    dense_routing,
    moe_experts,
    moe_experts_loop,
    moe_experts_ref,
)


def random_moe(T, H, I, E, k, activation, seed=0, dtype=torch.float32, weights_dtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    rows = 2 * I if activation == "swiglu" else I
    w_in = (torch.randn(E, rows, H, generator=g) / H ** 0.5).to(dtype)
    w_out = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]  # k distinct experts per token
    w = torch.rand(T, k, generator=g).to(weights_dtype or torch.float32)
    return x, w_in, w_out, ids, w


def per_token(x, w_in, w_out, ids, w, activation):
    out = torch.zeros(x.shape, dtype=torch.float64)
    I = w_out.shape[-1]
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            h = w_in[e].double() @ x[t].double()
            a = torch.relu(h) ** 2 if activation == "relu2" else F.silu(h[:I]) * h[I:]
            out[t] += w[t, j].double() * (w_out[e].double() @ a)
    return out


@pytest.mark.parametrize("activation", ["relu2", "swiglu"])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (9, 6, 1), (17, 16, 6), (5, 4, 4)])
def test_reference_and_loop_match_a_per_token_loop(activation, T, E, k):
    x, w_in, w_out, ids, w = random_moe(T, 12, 8, E, k, activation, seed=T * E + k)
    expected = per_token(x, w_in, w_out, ids, w, activation).float()
    for fn in (moe_experts_ref, moe_experts_loop, moe_experts):
        torch.testing.assert_close(fn(x, w_in, w_out, ids, w, activation), expected,
                                   rtol=1e-5, atol=1e-5)


def test_model_dtype_weights_round_each_product_like_the_dense_reference():
    x, w_in, w_out, ids, w = random_moe(7, 16, 8, 5, 2, "swiglu", seed=3, dtype=torch.bfloat16,
                                        weights_dtype=torch.bfloat16)
    torch.testing.assert_close(moe_experts_loop(x, w_in, w_out, ids, w, "swiglu"),
                               moe_experts_ref(x, w_in, w_out, ids, w, "swiglu"),
                               rtol=1e-6, atol=1e-6)


def test_dense_routing_scatters_the_chosen_weights():
    ids = torch.tensor([[2, 0], [1, 3]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
    assert dense_routing(ids, w, 4).tolist() == [[0.75, 0, 0.25, 0], [0, 0.5, 0, 0.5]]


def test_unknown_activation_is_refused():
    x, w_in, w_out, ids, w = random_moe(2, 8, 4, 3, 1, "relu2")
    with pytest.raises(ValueError, match="activation"):
        moe_experts(x, w_in, w_out, ids, w, "gelu")


triton = pytest.importorskip("triton")
from mambaserve.ops.triton.moe_align import align_pairs_torch, padded_pairs  # noqa: E402


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("T,E,k", [(1, 128, 6), (3, 4, 4), (64, 8, 2), (512, 72, 8),
                                   (33, 16, 1)])
def test_torch_align_lays_each_expert_out_in_padded_blocks(T, E, k, block_m):
    g = torch.Generator().manual_seed(T + E)
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k]
    if T >= 3:
        ids[: T // 2, 0] = 1  # many tokens on one expert; others may get none
    sorted_pairs, block_expert = align_pairs_torch(ids, E, block_m)
    P = T * k
    assert sorted_pairs.numel() == padded_pairs(P, E, block_m)
    assert block_expert.numel() * block_m == sorted_pairs.numel()
    flat = ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < P]
    assert sorted(real.tolist()) == list(range(P))  # every pair exactly once
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m:(b + 1) * block_m]
        rows = rows[rows < P]
        if e < 0:
            assert rows.numel() == 0
            continue
        assert rows.numel() > 0 and (flat[rows.long()] == e).all()  # one expert per block
        assert rows.tolist() == sorted(rows.tolist())  # pair order within an expert
    used = block_expert[block_expert >= 0]
    assert used.tolist() == sorted(used.tolist())
    assert set(used.tolist()) == set(flat.tolist())
