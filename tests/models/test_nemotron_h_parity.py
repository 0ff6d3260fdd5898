"""Model math against transformers' NemotronHForCausalLM (float32, random tiny configs)."""

import pytest
import torch
from tiny_checkpoint import load_hf, make_tiny_checkpoint

from mambaserve import LLM, SamplingParams


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), use_cache=False).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def engine_prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    return torch.tensor([d[t] for d, t in zip(out.prompt_logprobs[1:], ids[1:])])


@pytest.mark.parametrize("length", [1 + 1, 7, 8, 9, 37])
def test_full_prefill_prompt_logprobs_match_hf(tiny_ckpt, hf_model, length):
    llm = LLM(tiny_ckpt, chunked_prefill_size=4096)
    ids = torch.randint(3, 320, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    torch.testing.assert_close(engine_prompt_logprobs(llm, ids), hf_prompt_logprobs(hf_model, ids),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("budget", [1, 3, 5, 8, 13])
def test_chunked_prefill_matches_full_prefill(tiny_ckpt, hf_model, budget):
    """Token budgets that split the prompt at arbitrary points, inside and across chunk_size
    (8) blocks, give the same logprobs as one full prefill."""
    ids = torch.randint(3, 320, (29,), generator=torch.Generator().manual_seed(budget)).tolist()
    full = engine_prompt_logprobs(LLM(tiny_ckpt, chunked_prefill_size=4096), ids)
    llm = LLM(tiny_ckpt, chunked_prefill_size=budget)
    chunked = engine_prompt_logprobs(llm, ids)
    assert llm.engine.stats["chunked_prefills"] >= 29 // budget
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked, hf_prompt_logprobs(hf_model, ids), rtol=0, atol=1e-4)


@pytest.mark.parametrize("seed, overrides, layers", [
    (11, {}, ["linear_attention", "linear_attention", "full_attention", "moe"]),
    (12, {"n_groups": 1, "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8,
          "chunk_size": 4, "conv_kernel": 3, "num_key_value_heads": 4},
     ["linear_attention", "mlp", "full_attention", "linear_attention", "moe"]),
    (13, {"n_groups": 8, "n_group": 2, "topk_group": 1, "chunk_size": 16},
     ["moe", "linear_attention", "full_attention", "mlp"]),
])
def test_other_shapes_match_hf(tmp_path, seed, overrides, layers):
    path = make_tiny_checkpoint(tmp_path / "ck", seed=seed, layers=layers, **overrides)
    hf = load_hf(path)
    llm = LLM(path, chunked_prefill_size=6)
    ids = torch.randint(3, 320, (23,), generator=torch.Generator().manual_seed(seed)).tolist()
    torch.testing.assert_close(engine_prompt_logprobs(llm, ids), hf_prompt_logprobs(hf, ids),
                               rtol=0, atol=1e-4)
