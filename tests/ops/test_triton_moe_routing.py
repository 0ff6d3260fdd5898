"""Triton MoE routing vs the routers' torch math (CPU interpreter without CUDA; compiled with
it): softmax over the top k (Granite) and sigmoid scores + bias (NemotronH), expert counts that
are and are not powers of two, k from 1 to all experts, logits in float32 / float16, ties."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, decide_as_cuda, require_interpreter  # before anything imports triton

from mambaserve.ops.moe_routing import (
    sigmoid_topk,
    sigmoid_topk_ref,
    softmax_topk,
    softmax_topk_ref,
)
from mambaserve.ops.triton.moe_routing import _route_kernel, route_topk_triton

require_interpreter(_route_kernel)


def logits_of(T, E, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * 2).to(dtype=dtype, device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k", [(1, 72, 10), (5, 8, 2), (9, 40, 1), (3, 6, 6), (33, 128, 8)])
def test_softmax_topk_matches_the_router(T, E, k, dtype):
    logits = logits_of(T, E, seed=T * E + k, dtype=dtype)
    ids, w = route_topk_triton(logits, k, dtype)
    want_ids, want_w = softmax_topk_ref(logits, k, dtype)
    # descending, as torch's sorted topk; among equal logits (fp16 has ties) the order may differ
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert all(len(set(row)) == k for row in ids.tolist())
    if dtype == torch.float32:
        assert torch.equal(ids, want_ids)
    assert w.dtype == dtype
    torch.testing.assert_close(w.float(), want_w.float(), rtol=0, atol=1e-6 if dtype ==
                               torch.float32 else 1e-3)


@pytest.mark.parametrize("normalize,scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("T,E,k", [(1, 128, 6), (7, 20, 3), (16, 64, 8)])
def test_sigmoid_topk_matches_the_router(T, E, k, normalize, scale):
    logits = logits_of(T, E, seed=E + k)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)).to(DEV) * 0.1
    ids, w = route_topk_triton(logits, k, torch.float32, bias=bias, normalize=normalize,
                               scale=scale)
    want_ids, want_w = sigmoid_topk_ref(logits, bias, k, normalize, scale)
    # the reference's topk is unsorted: compare as sets of (expert, weight) per token
    order, want_order = ids.argsort(1), want_ids.argsort(1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order), rtol=1e-6,
                               atol=1e-7)
    choice = torch.sigmoid(logits) + bias  # descending order of the choice scores
    picked = choice.gather(1, ids)
    assert bool((picked[:, :-1] >= picked[:, 1:]).all())


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # softmax of an all -inf row
def test_ties_go_to_the_lowest_expert_and_never_repeat():
    logits = torch.zeros(2, 12, device=DEV)
    logits[0, 5] = 1.0  # one leader, then eleven equal
    logits[1] = float("-inf")  # all equal at -inf
    ids, w = route_topk_triton(logits, 4, torch.float32)
    assert ids.tolist() == [[5, 0, 1, 2], [0, 1, 2, 3]]
    assert torch.isfinite(w[0]).all()


def test_nan_counts_as_the_largest():
    logits = logits_of(1, 16, seed=3)
    logits[0, 9] = float("nan")
    ids, _ = route_topk_triton(logits, 3, torch.float32)
    assert ids[0, 0].item() == 9 and len(set(ids[0].tolist())) == 3


def test_public_ops_take_the_reference_off_cuda_and_check_their_inputs():
    logits = logits_of(4, 16, seed=0)
    ids, w = softmax_topk(logits, 4, torch.float16)
    if DEV == "cpu":
        want = softmax_topk_ref(logits, 4, torch.float16)
        assert torch.equal(ids, want[0]) and torch.equal(w, want[1])
    bias = torch.zeros(16, device=DEV)
    assert sigmoid_topk(logits, bias, 2, True, 1.0)[0].shape == (4, 2)
    with pytest.raises(ValueError, match="1 <= k <= experts"):
        softmax_topk(logits, 17, torch.float32)
    with pytest.raises(ValueError, match="float32 logits"):
        sigmoid_topk(logits.half(), bias, 2, True, 1.0)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid_grouped"])
def test_moe_layer_routes_through_the_kernel_as_through_the_reference(monkeypatch, router):
    """A whole MoE block (Granite's softmax router, NemotronH's sigmoid one with every group
    kept) with its routing on the kernel path (the interpreter on the CPU) gives the reference
    path's output."""
    import types

    from mambaserve.layers.moe import MoE
    from mambaserve.ops import moe_routing

    cfg = types.SimpleNamespace(
        n_routed_experts=12, num_experts_per_tok=3, hidden_size=16, moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=12, moe_router=router, mlp_bias=False, n_group=1,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5)
    moe = MoE(cfg).to(DEV)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in list(moe.parameters()) + list(moe.buffers()):
            p.copy_(torch.randn(p.shape, generator=g).to(DEV) / p.shape[-1] ** 0.5)
    x = torch.randn(9, 16, generator=g).to(DEV)
    with torch.no_grad():
        want = moe(x)
        decided = decide_as_cuda(monkeypatch, moe_routing)
        got = moe(x)
    assert DEV == "cuda" or decided == ["triton"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
