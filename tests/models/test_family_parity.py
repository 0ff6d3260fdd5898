"""Every hybrid family against its transformers class (float32, tiny random checkpoints from
tests/family_checkpoints.py): prompt logprobs, greedy tokens of ragged prompts under a token
budget small enough for chunked prefill and mixed batches, and prefix caching on vs off."""

import pytest
import torch
from family_checkpoints import (
    DT_LIMIT,
    FALCON_H1_BIASES,
    FALCON_H1_NO_MAMBA_NORM,
    FALCON_H1_NORM_BEFORE_GATE,
    MAKERS,
    hf_greedy,
    hf_prompt_logprobs,
    load_hf,
    rewrite_config_hub_style,
)

from mambaserve import LLM, SamplingParams

# (architecture, seed, maker overrides); each family adds its variants here
CASES = [
    ("BambaForCausalLM", 0, {}),
    ("BambaForCausalLM", 1, {"attn_layer_indices": [0, 2]}, "hub"),
    # FalconH1ForCausalLM cases
    ("FalconH1ForCausalLM", 0, {}),  # gated norm (gate first), every multiplier != 1
    # no gated norm, tied embeddings with both multipliers (Falcon-H1-Tiny / 0.5B settings)
    ("FalconH1ForCausalLM", 1, {**FALCON_H1_NO_MAMBA_NORM, "tie_word_embeddings": True}),
    ("FalconH1ForCausalLM", 2, FALCON_H1_NORM_BEFORE_GATE, "hub"),
    ("FalconH1ForCausalLM", 3, {**FALCON_H1_BIASES, **DT_LIMIT}),  # every bias; dt clamp bites
    # GraniteMoeHybridForCausalLM cases
    ("GraniteMoeHybridForCausalLM", 0, {}),  # 4 experts top-2 + shared MLP, NoPE
    ("GraniteMoeHybridForCausalLM", 1, {"num_local_experts": 0}),  # dense: shared MLP only
    ("GraniteMoeHybridForCausalLM", 2, {"position_embedding_type": "rope"}, "hub"),
    # Mamba2ForCausalLM cases
    ("Mamba2ForCausalLM", 0, {}),
    ("Mamba2ForCausalLM", 1, {"tie_word_embeddings": True, "n_groups": 1}, "hub"),
]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    return torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def family(request, tmp_path_factory):
    """(checkpoint, transformers' model, seed); a case marked "hub" has its config.json rewritten
    in the older spellings published checkpoints use (transformers reads both the same)."""
    arch, seed, overrides, *style = request.param
    path = MAKERS[arch](tmp_path_factory.mktemp(arch) / "ckpt", seed=seed, **overrides)
    hf = load_hf(path)
    if style == ["hub"]:
        rewrite_config_hub_style(path)
    return path, hf, seed


@pytest.mark.parametrize("budget", [4096, 5])
def test_prompt_logprobs_match_hf(family, budget):
    path, hf, seed = family
    ids = _ids(29, seed)
    llm = LLM(path, chunked_prefill_size=budget, device="cpu")
    torch.testing.assert_close(engine_prompt_logprobs(llm, ids), hf_prompt_logprobs(hf, ids),
                               rtol=0, atol=1e-4)


def test_greedy_ragged_batch_matches_hf(family):
    path, hf, seed = family
    prompts = [_ids(n, seed + n) for n in (3, 11, 20)]
    llm = LLM(path, chunked_prefill_size=12, max_num_seqs=3, device="cpu")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert llm.engine.stats["mixed_steps"] > 0 and llm.engine.stats["chunked_prefills"] > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 8)


def test_prefix_cache_on_matches_off(family):
    path, _, seed = family
    system = _ids(40, seed + 100)
    prompts = [system + _ids(5, seed + i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    off = LLM(path, chunked_prefill_size=16, device="cpu")
    on = LLM(path, chunked_prefill_size=16, device="cpu", enable_prefix_caching=True)
    ref = [o.outputs[0].token_ids for o in off.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    got = []
    for p in prompts:  # one at a time so later prompts hit the first one's snapshots
        got.append(on.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids)
    assert got == ref
    assert on.engine.cache_stats()["hits"] >= 1
    on.engine.check_integrity()


def test_forwards_are_sync_free(family):
    from mambaserve.config import EngineConfig
    from mambaserve.engine.llm_engine import LLMEngine
    from mambaserve.tools.audit_scenarios import format_report, run_scenarios

    path, _, _ = family
    engine = LLMEngine(path, EngineConfig(chunked_prefill_size=16, max_num_seqs=4, device="cpu",
                                          enable_prefix_caching=True))
    results = run_scenarios(engine)
    report = format_report(results)
    for name, r in results.items():
        assert r.forwards > 0, f"scenario {name} did not occur\n{report}"
        assert r.forward_syncs == 0 and r.sampler_syncs == 0, report
        assert r.step_syncs == r.readback_syncs == r.expected_readbacks, report


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_on_gpu(family):
    path, _, seed = family
    kw = {"device": "cuda", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 8,
          "chunked_prefill_size": 32, "enable_prefix_caching": True,
          "memory_budget_bytes": 64 << 20}
    prompts = [{"prompt_token_ids": _ids(n, seed + n)} for n in (5, 17, 33, 9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = LLM(path, enforce_eager=True, **kw).generate(prompts, params)
    graph_llm = LLM(path, cuda_graph_max_bs=8, **kw)
    assert graph_llm.engine.runner.graph_runner.graphs
    graph = graph_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in graph] == [o.outputs[0].token_ids for o in eager]
    graph_llm.engine.check_integrity()
