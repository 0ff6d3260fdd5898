"""KV pages on demand and preemption under a tiny memory budget: every request completes with
the output of an unconstrained run, the pools return to idle, integrity holds after every step,
and the preemptions are counted."""

import pytest
import torch
from test_prefix_cache import run_checked  # generate() step by step, integrity after each step

from mambaserve import LLM, SamplingParams
from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.config import ModelConfig

REF = {"memory_budget_bytes": 32 << 20}  # the unconstrained reference: pools sized by limits


def toks(n, seed):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tiny_pools(tiny_ckpt, slots: int, pages: int, **kw) -> LLM:
    """An engine whose pools hold exactly `slots` state slots and `pages` KV pages."""
    cfg = ModelConfig.from_hf(tiny_ckpt)
    slot_b = StatePool.bytes_per_slot(cfg, torch.float32, torch.float32)
    page_b = KVPool.bytes_per_page(cfg, 16, torch.float32)
    assert pages * page_b >= slots * slot_b  # the pool sizing splits the budget in halves
    llm = LLM(tiny_ckpt, memory_budget_bytes=slots * slot_b + pages * page_b,
              max_model_len=256, **kw)
    assert (llm.engine.state_pool.num_slots, llm.engine.kv_pool.num_pages) == (slots, pages)
    return llm


def workload(n=8):
    prompts = [toks(20 + 7 * i, i) for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logprobs=1)
              if i % 2 else
              SamplingParams(temperature=1.0, seed=100 + i, max_tokens=75, ignore_eos=True)
              for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def unconstrained(tiny_ckpt):
    prompts, params = workload()
    return LLM(tiny_ckpt, max_num_seqs=8, chunked_prefill_size=32, **REF).generate(
        [{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no-cache", "prefix-cache"])
def test_tiny_budget_preempts_and_every_output_is_unchanged(tiny_ckpt, unconstrained, prefix,
                                                            overlap):
    prompts, params = workload()
    ref = unconstrained
    slots = 6 if not prefix else 8
    llm = tiny_pools(tiny_ckpt, slots=slots, pages=32, max_num_seqs=6, chunked_prefill_size=32,
                     enable_prefix_caching=prefix, async_scheduling=overlap)
    eng = llm.engine
    got = run_checked(llm, prompts, params)
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "length"
        if r.outputs[0].logprobs is not None:
            for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a)
    assert eng.stats["preemptions"] == eng.scheduler.num_preemptions > 0
    assert eng.state_pool.num_free + (eng.prefix_cache.num_snapshots if prefix else 0) == slots
    if prefix:
        eng.prefix_cache.evict(slots=slots, pages=eng.kv_pool.num_pages)
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == (slots, eng.kv_pool.num_pages)


def test_pages_grow_with_the_request(tiny_ckpt):
    """A request holds the pages it has written plus the next step's, not prompt + max_tokens."""
    llm = tiny_pools(tiny_ckpt, slots=2, pages=16, max_num_seqs=2)
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": toks(20, 0)},
                    SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.step()  # the prompt (20 tokens) and the first token
    (req,) = eng.scheduler.running
    assert len(req.pages) == 2
    while len(req.output_token_ids) < 13:
        eng.step()
    assert len(req.pages) == 2  # 32 tokens written, the next one goes to position 32
    eng.step()
    assert len(req.pages) == 3
    eng.abort_request("a")
    assert eng.kv_pool.num_free == 16


def test_omitted_max_tokens_runs_up_to_the_length_limit(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_model_len=64, max_num_seqs=4, **REF)
    outs = llm.generate([{"prompt_token_ids": toks(10, i)} for i in range(4)],
                        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 54 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_prompt_logprobs_survive_a_preemption(tiny_ckpt):
    """A request preempted mid-prefill recomputes its prompt logprobs; one preempted after its
    prompt keeps them; both equal an unconstrained run."""
    prompts = [toks(70, 1), toks(60, 2), toks(50, 3)]
    params = [SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, prompt_logprobs=1)
              for _ in prompts]
    ref = LLM(tiny_ckpt, max_num_seqs=4, chunked_prefill_size=16, **REF).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    llm = tiny_pools(tiny_ckpt, slots=3, pages=14, max_num_seqs=3, chunked_prefill_size=16)
    got = run_checked(llm, prompts, params)
    assert llm.engine.stats["preemptions"] > 0
    for g, r in zip(got, ref):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-3 for k in a)
        # the ranks stay aligned with the prompt: rank 1 where the token is its top alternative
        ranks = g.prompt_logprob_ranks
        assert len(ranks) == len(g.prompt_logprobs) and ranks[0] is None
        assert [r == 1 for r in ranks[1:]] == [len(d) == 1 for d in g.prompt_logprobs[1:]]


def test_preempted_request_goes_to_the_front_and_resumes(tiny_ckpt):
    llm = tiny_pools(tiny_ckpt, slots=2, pages=8, max_num_seqs=2)
    eng = llm.engine
    p = SamplingParams(temperature=1.0, seed=4, max_tokens=60, ignore_eos=True)
    eng.add_request("old", {"prompt_token_ids": toks(30, 5)}, p)
    eng.add_request("new", {"prompt_token_ids": toks(30, 6)}, p)
    eng.add_request("later", {"prompt_token_ids": toks(5, 7)}, p)
    while not eng.scheduler.num_preemptions:
        eng.step()
        eng.check_integrity()
    assert [r.request_id for r in eng.scheduler.running] == ["old"]
    assert [r.request_id for r in eng.scheduler.waiting] == ["new", "later"]
    new = eng.scheduler.waiting[0]
    assert new.recompute_len == 30 + len(new.output_token_ids) and new.state_slot == -1
    assert new.pages == [] and new.num_preemptions == 1


@pytest.mark.parametrize("prefix", [False, True], ids=["no-cache", "prefix-cache"])
def test_early_stops_under_pressure_with_overlap(tiny_ckpt, prefix):
    """Requests that stop on a token id (so a row runs past the stop and holds its pages until
    collected) in a pool that forces preemptions: the overlapped loop waits for the step in
    flight where it must, and every output equals an unconstrained synchronous run."""
    prompts = [toks(15 + 9 * (i % 5), 50 + i) for i in range(10)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=70,
                             stop_token_ids=list(range(3 + 7 * i, 9 + 7 * i)) if i % 2 else None,
                             ignore_eos=not i % 2)
              for i in range(10)]
    ref = LLM(tiny_ckpt, max_num_seqs=10, chunked_prefill_size=32, **REF).generate(
        [{"prompt_token_ids": p} for p in prompts], params)
    llm = tiny_pools(tiny_ckpt, slots=6 if not prefix else 8, pages=32, max_num_seqs=6,
                     chunked_prefill_size=32, enable_prefix_caching=prefix,
                     async_scheduling=True)
    got = run_checked(llm, prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert [g.outputs[0].finish_reason for g in got] == [r.outputs[0].finish_reason for r in ref]
    assert any(r.outputs[0].finish_reason == "stop" for r in ref)
    assert llm.engine.stats["preemptions"] > 0
