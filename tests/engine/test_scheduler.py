"""Admission under a tight memory budget, waiting, aborts, and pool accounting."""

import torch

from mambaserve import LLM, SamplingParams
from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool


def rand_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 320, (n,), generator=g).tolist()}
            for n in lengths]


def tight_llm(tiny_ckpt, slots: int, **kw) -> LLM:
    """An engine whose memory budget holds exactly `slots` state slots (+ a few KV pages)."""
    probe = LLM(tiny_ckpt, max_num_seqs=1)
    eng = probe.engine
    slot_b = StatePool.bytes_per_slot(eng.model_config, eng.dtype, eng.ssm_dtype)
    page_b = KVPool.bytes_per_page(eng.model_config, 16, eng.dtype)
    budget = 2 * slots * slot_b + kw.pop("extra_pages", 0) * page_b
    return LLM(tiny_ckpt, memory_budget_bytes=budget, max_num_seqs=8, max_model_len=256,
               chunked_prefill_size=32, **kw)


def test_requests_wait_for_slots_and_all_complete(tiny_ckpt):
    llm = tight_llm(tiny_ckpt, slots=2)
    eng = llm.engine
    assert eng.state_pool.num_slots == 2
    free_slots, free_pages = eng.state_pool.num_free, eng.kv_pool.num_free
    prompts = rand_prompts([7, 12, 5, 9, 3, 11])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    max_running = 0
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        max_running = max(max_running, len(eng.scheduler.running))
        assert eng.state_pool.num_free + len(eng.scheduler.running) == 2
    assert max_running == 2
    assert len(done) == 6 and all(len(o.outputs[0].token_ids) == 10 for o in done.values())
    # same tokens as an unconstrained engine
    ref = LLM(tiny_ckpt, max_num_seqs=8).generate(prompts, params)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(6)] == \
        [o.outputs[0].token_ids for o in ref]
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == (free_slots, free_pages)


def test_admission_takes_the_first_chunks_pages_not_the_whole_length(tiny_ckpt):
    llm = tight_llm(tiny_ckpt, slots=4)
    eng = llm.engine
    pages = eng.kv_pool.num_pages
    # prompt + max_tokens of each is more than half the pool: both run at once all the same
    n_tokens = (pages // 2 + 1) * eng.kv_pool.page_size - 20
    params = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    eng.add_request("a", rand_prompts([20])[0], params)
    eng.add_request("b", rand_prompts([20], seed=1)[0], params)
    eng.step()
    assert [len(r.pages) for r in eng.scheduler.running] == [2, 1]  # 20 and 12 of 32 tokens
    assert not eng.scheduler.waiting
    eng.abort_request("a")
    eng.step()
    assert [r.request_id for r in eng.scheduler.running] == ["b"]
    eng.abort_request("b")
    assert eng.kv_pool.num_free == pages and eng.state_pool.num_free == 4


def test_request_larger_than_pool_is_refused(tiny_ckpt):
    llm = tight_llm(tiny_ckpt, slots=1)
    eng = llm.engine
    import pytest

    too_long = eng.kv_pool.num_pages * eng.kv_pool.page_size + 1
    assert too_long < eng.max_model_len  # the pool, not the length limit, refuses it
    with pytest.raises(ValueError, match="KV pages"):
        llm.generate(rand_prompts([too_long - 1])[0], SamplingParams(max_tokens=2))
    assert not eng.has_unfinished_requests() and eng.kv_pool.num_free == eng.kv_pool.num_pages


def test_abort_frees_everything_midway(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_seqs=4, chunked_prefill_size=8)
    eng = llm.engine
    start = (eng.state_pool.num_free, eng.kv_pool.num_free)
    params = SamplingParams(temperature=1.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(rand_prompts([30, 4, 17, 9, 22, 6])):
        eng.add_request(f"x{i}", p, params)
    for _ in range(3):
        eng.step()  # x0 mid-prefill, others decoding or waiting
    assert any(not r.prefill_done for r in eng.scheduler.running)
    for i in range(6):
        assert eng.abort_request(f"x{i}")
    assert not eng.has_unfinished_requests()
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == start
    assert eng.abort_request("x0") is False
    # the engine still works afterwards
    out = llm.generate(rand_prompts([5])[0], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) <= 4
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == start


def test_memory_budget_too_small(tiny_ckpt):
    import pytest

    with pytest.raises(ValueError, match="memory budget .* too small"):
        LLM(tiny_ckpt, memory_budget_bytes=1000)


def test_pools_take_exactly_what_the_limits_need_when_it_fits(tiny_ckpt):
    """A budget that holds max_num_seqs slots and every sequence's pages at full length gives
    exactly that (no half-budget split starving the slots); a tighter one splits it."""
    probe = LLM(tiny_ckpt, max_num_seqs=1).engine
    slot_b = StatePool.bytes_per_slot(probe.model_config, probe.dtype, probe.ssm_dtype)
    page_b = KVPool.bytes_per_page(probe.model_config, 16, probe.dtype)
    seqs, pages_per_seq = 6, 256 // 16
    need = seqs * slot_b + seqs * pages_per_seq * page_b
    eng = LLM(tiny_ckpt, memory_budget_bytes=need, max_num_seqs=seqs, max_model_len=256).engine
    assert (eng.state_pool.num_slots, eng.kv_pool.num_pages) == (seqs, seqs * pages_per_seq)
    tight = LLM(tiny_ckpt, memory_budget_bytes=need - 1, max_num_seqs=seqs,
                max_model_len=256).engine
    n = tight.state_pool.num_slots
    assert 1 <= n and n * slot_b <= need // 2
    assert n * slot_b + tight.kv_pool.num_pages * page_b <= need


def test_prefill_is_capped_per_step_while_decodes_run(tiny_ckpt):
    """A new arrival's prompt goes in max_step_prefill_tokens slices while others decode, in
    whole chunked_prefill_size chunks when nothing decodes; the outputs do not change."""
    llm = LLM(tiny_ckpt, chunked_prefill_size=64, max_step_prefill_tokens=8, max_num_seqs=4)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seen = []
    eng.runner.on_forward = lambda batch, meta: seen.append(
        ([r.num_tokens for r in batch.prefills], len(batch.decodes)))
    prompts = rand_prompts([40, 30], seed=3)
    eng.add_request("a", prompts[0], params)
    eng.step()
    assert seen[-1] == ([40], 0)  # nothing decodes: the whole prompt at once
    eng.add_request("b", prompts[1], params)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert seen[1:5] == [([8], 1)] * 3 + [([6], 1)]
    ref = LLM(tiny_ckpt, chunked_prefill_size=64, max_num_seqs=4).generate(prompts, params)
    assert [done[k].outputs[0].token_ids for k in "ab"] == [o.outputs[0].token_ids for o in ref]


def test_steady_cap_applies_while_the_prefill_backlog_fits_the_big_cap(tiny_ckpt):
    """With decodes running: a backlog above max_step_prefill_tokens goes in max-cap slices, the
    last max-cap tokens (and a lone small arrival) in steady_step_prefill_tokens slices; the
    outputs do not change."""
    kw = {"chunked_prefill_size": 64, "max_num_seqs": 4}
    llm = LLM(tiny_ckpt, max_step_prefill_tokens=16, steady_step_prefill_tokens=4, **kw)
    eng = llm.engine
    assert (eng.scheduler.max_step_prefill_tokens, eng.scheduler.steady_step_prefill_tokens) \
        == (16, 4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seen = []
    eng.runner.on_forward = lambda batch, meta: seen.append(
        [r.num_tokens for r in batch.prefills])
    prompts = rand_prompts([40, 30, 10], seed=5)
    eng.add_request("a", prompts[0], params)
    eng.step()  # nothing decodes: a's whole prompt
    eng.add_request("b", prompts[1], params)
    assert eng.scheduler.prefill_backlog() == 30
    done = {}
    for _ in range(8):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    # b: 30 > 16 -> a 16-token slice; then 14 <= 16 -> steady slices of 4
    assert seen[1:6] == [[16], [4], [4], [4], [2]]
    eng.add_request("c", prompts[2], params)  # a lone 10-token arrival: steady slices at once
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert [4] in seen[9:] and [16] not in seen[6:] and [10] not in seen[6:]
    ref = LLM(tiny_ckpt, **kw).generate(prompts, params)
    assert [done[k].outputs[0].token_ids for k in "abc"] == [o.outputs[0].token_ids for o in ref]


def test_steady_cap_defaults_to_the_largest_prefill_graph_bucket(tiny_ckpt):
    """Unset, the steady cap is the largest prefill-graph bucket where those graphs exist (the
    uncaptured static-buffer path on a CPU), else no tighter cap than max_step_prefill_tokens."""
    on = LLM(tiny_ckpt, enforce_eager=False, cuda_graph_max_prefill_tokens=32,
             chunked_prefill_size=64, max_num_seqs=4).engine
    assert on.scheduler.steady_step_prefill_tokens == 32
    off = LLM(tiny_ckpt, chunked_prefill_size=64, max_num_seqs=4).engine
    assert off.scheduler.steady_step_prefill_tokens == off.scheduler.max_step_prefill_tokens


def test_max_step_prefill_tokens_must_be_positive():
    import pytest

    from mambaserve.config import EngineConfig

    with pytest.raises(ValueError, match="max_step_prefill_tokens must be >= 1"):
        EngineConfig(max_step_prefill_tokens=0).validate()
