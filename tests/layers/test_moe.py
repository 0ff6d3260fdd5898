"""The softmax-top-k MoE (GraniteMoeHybrid): router + SwiGLU experts + shared SwiGLU MLP against a
plain per-token loop, and against transformers' own modules (bit-identical in bf16 to its
default grouped_mm experts path)."""

import types

import pytest
import torch
import torch.nn.functional as F

from mambaserve.layers.moe import MoE
from mambaserve.ops.moe_experts import dense_routing

E, H, I, S, K = 6, 16, 8, 12, 2


def granite_moe(seed: int = 0, experts: int = E, top_k: int = K) -> MoE:
    cfg = types.SimpleNamespace(n_routed_experts=experts, num_experts_per_tok=top_k,
                                hidden_size=H, moe_intermediate_size=I,
                                moe_shared_expert_intermediate_size=S,
                                moe_router="softmax_topk", mlp_bias=False)
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return moe


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token: softmax over its top-k router logits, the chosen experts' SwiGLU outputs
    weighted and summed, plus the shared MLP."""
    Wr, Wgu, Wd = moe.router.weight, moe.experts_gate_up, moe.experts_down
    shared = moe.shared_experts
    rows = []
    for t in range(x.shape[0]):
        g, u = (shared.gate_up_weight.reshape(2 * S, H) @ x[t]).chunk(2)
        y = shared.down_proj.weight @ (F.silu(g) * u)
        top_v, top_i = (Wr @ x[t]).topk(moe.router.top_k)
        for w, e in zip(torch.softmax(top_v, -1), top_i.tolist()):
            g, u = (Wgu[e] @ x[t]).chunk(2)  # first half = gate
            y = y + w * (Wd[e] @ (F.silu(g) * u))
        rows.append(y)
    return torch.stack(rows)


@torch.no_grad()
def test_matches_a_per_token_loop_with_shared_and_unused_experts():
    moe = granite_moe()
    # router = the first E hidden channels: token t's logits are x[t, :E], so routing is chosen
    moe.router.weight.copy_(torch.eye(E, H))
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(1))
    x[:, :E] = -5.0
    x[:4, 1], x[:4, 3] = 2.0, 1.0  # tokens 0-3 all pick experts 1 and 3
    x[4, 1], x[4, 0] = 0.5, 3.0  # token 4: experts 0 and 1
    x[5, 2], x[5, 4] = 1.0, 1.5  # token 5: experts 4 and 2
    x[6, 3], x[6, 2] = 0.0, 0.1  # token 6: experts 2 and 3; expert 5 gets no token
    chosen = dense_routing(*moe.router(x), E) != 0
    assert chosen.sum(1).eq(K).all() and chosen[:, 5].sum() == 0 and chosen[:, 1].sum() == 5
    torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("top_k", [1, 3, E])
def test_random_routing_matches_a_per_token_loop(top_k):
    moe = granite_moe(seed=top_k, top_k=top_k)
    x = torch.randn(33, H, generator=torch.Generator().manual_seed(2))
    weights = dense_routing(*moe.router(x), E)
    assert weights.dtype == x.dtype and (weights != 0).sum(1).eq(top_k).all()
    torch.testing.assert_close(weights.sum(1), torch.ones(33))
    torch.testing.assert_close(moe(x), per_token_reference(moe, x), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_matches_transformers_modules_bit_for_bit_in_bf16():
    import transformers
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

    cfg = transformers.GraniteMoeHybridConfig(
        hidden_size=H, intermediate_size=I, shared_intermediate_size=S, num_local_experts=E,
        num_experts_per_tok=K, num_attention_heads=4, mamba_n_heads=4)
    cfg._experts_implementation = "grouped_mm"  # transformers' default for the full model
    hf_moe, hf_mlp = hf.GraniteMoeHybridMoE(cfg), hf.GraniteMoeHybridMLP(cfg)
    moe = granite_moe(seed=3)
    hf_moe.router.weight.copy_(moe.router.weight)
    hf_moe.experts.gate_up_proj.copy_(moe.experts_gate_up)
    hf_moe.experts.down_proj.copy_(moe.experts_down)
    hf_mlp.input_linear.weight.copy_(moe.shared_experts.gate_up_weight.reshape(2 * S, H))
    hf_mlp.output_linear.weight.copy_(moe.shared_experts.down_proj.weight)
    x = torch.randn(1, 40, H, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float32, torch.bfloat16):
        for m in (moe, hf_moe, hf_mlp):
            m.to(dtype)
        xd = x.to(dtype)
        ref = (hf_moe(xd) + hf_mlp(xd))[0]
        if dtype is torch.float32:
            torch.testing.assert_close(moe(xd[0]), ref, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(moe(xd[0]), ref)


def test_unknown_router_kind_raises():
    cfg = types.SimpleNamespace(n_routed_experts=E, num_experts_per_tok=K, hidden_size=H,
                                moe_intermediate_size=I, moe_shared_expert_intermediate_size=S,
                                moe_router="sigmoid", mlp_bias=False)
    with pytest.raises(ValueError, match="moe_router"):
        MoE(cfg)
