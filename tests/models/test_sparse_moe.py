"""Whole models with MoE layers (tiny NemotronH with "E" layers, tiny GraniteMoeHybrid) run with
the sparse experts kernel against the dense reference they use on the CPU: the same greedy
tokens for a ragged batch with chunked prefill and mixed steps, prompt logprobs within float32
tolerance. The op's dispatch is pointed at one path or the other; without CUDA the kernel runs
under Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton
pytest.importorskip("triton")

from family_checkpoints import make_tiny_granite_moe_hybrid  # noqa: E402
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

import mambaserve.ops.moe_experts as moe_op  # noqa: E402
from mambaserve import LLM, SamplingParams  # noqa: E402
from mambaserve.model_layout import FFNKind  # noqa: E402
from mambaserve.ops.triton.moe_experts import _moe_in_kernel  # noqa: E402

if not torch.cuda.is_available() and type(_moe_in_kernel).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set",
                allow_module_level=True)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(path, monkeypatch, sparse: bool):
    calls = []
    path_taken = "triton" if sparse else "reference"
    monkeypatch.setattr(moe_op, "kernel_path",
                        lambda op, device, **kw: calls.append(op) or path_taken)
    llm = LLM(path, chunked_prefill_size=12, max_num_seqs=3, device=DEV, dtype="float32",
              enforce_eager=True)
    prompts = [_ids(n, n) for n in (3, 11, 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                       prompt_logprobs=0))
    monkeypatch.undo()
    assert llm.engine.stats["mixed_steps"] > 0
    assert calls
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [torch.tensor([d[t] for d, t in zip(o.prompt_logprobs[1:], p[1:])])
                for o, p in zip(outs, prompts)]
    return tokens, logprobs


@pytest.fixture(scope="module", params=["NemotronH-E", "GraniteMoeHybrid"])
def moe_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    if request.param == "NemotronH-E":  # 8 experts in 2 groups, top-3 of the best group
        return make_tiny_checkpoint(path, seed=3,
                                    layers=["moe", "linear_attention", "full_attention", "moe"],
                                    n_routed_experts=8, n_group=2, topk_group=1,
                                    num_experts_per_tok=3)
    return make_tiny_granite_moe_hybrid(path, seed=3, num_local_experts=8,
                                        num_experts_per_tok=3)


def test_sparse_kernel_matches_the_dense_reference(moe_checkpoint, monkeypatch):
    dense_tokens, dense_lp = _run(moe_checkpoint, monkeypatch, sparse=False)
    sparse_tokens, sparse_lp = _run(moe_checkpoint, monkeypatch, sparse=True)
    assert sparse_tokens == dense_tokens
    for s, d in zip(sparse_lp, dense_lp):
        torch.testing.assert_close(s, d, rtol=0, atol=1e-5)


def test_memory_report_counts_the_expert_weights(moe_checkpoint):
    llm = LLM(moe_checkpoint, device="cpu")
    cfg = llm.engine.model_config
    E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    in_rows = 2 * I if cfg.moe_router == "softmax_topk" else I  # SwiGLU: [gate | up]
    moe_layers = sum(1 for spec in cfg.layers if spec.ffn is FFNKind.MOE)
    report = llm.engine.memory_report()
    assert report["expert_weight_bytes"] == moe_layers * E * (in_rows + I) * H * 4  # float32
    params = {id(p): p for p in llm.engine.model.parameters()}.values()
    assert report["weight_bytes"] == sum(p.numel() * 4 for p in params)
