"""Prefix caching for hybrid models: identical outputs with the cache on and off, hits where the
policy promises them, integrity after every step, eviction under memory pressure."""

import random

import pytest
import torch

from mambaserve import LLM, SamplingParams
from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool

I = 16  # default interval of the tiny model: lcm(chunk_size 8, page_size 16)


def toks(n, seed):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_checked(llm: LLM, prompts, params, salts=None):
    """generate() step by step, checking the engine's integrity after every step; `salts`: each
    prompt's cache_salt (None: unsalted)."""
    eng = llm.engine
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = f"q{llm._next_id}-{i}"
        salt = salts[i] if salts else None
        eng.add_request(rid, {"prompt_token_ids": p, **({"cache_salt": salt} if salt else {})},
                        sp)
        ids.append(rid)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
    llm._next_id += 1
    return [done[r] for r in ids]


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for dx, dy, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs,
                             x.outputs[0].token_ids):
            assert abs(dx[t] - dy[t]) < 1e-4


def engines(**kw):
    return (lambda ck: LLM(ck, enable_prefix_caching=True, **kw),
            lambda ck: LLM(ck, **kw))


@pytest.fixture()
def pair(tiny_ckpt):
    on, off = engines(chunked_prefill_size=24, max_num_seqs=4)
    return on(tiny_ckpt), off(tiny_ckpt)


GREEDY = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=1)


def test_multi_turn_reuses_up_to_last_snapshot(pair):
    on, off = pair
    conv, old_len = toks(23, 1), 0
    for turn in range(4):
        a = run_checked(on, [conv], [GREEDY])[0]
        b = run_checked(off, [conv], [GREEDY])[0]
        assert_same([a], [b])
        if turn == 0:
            assert a.num_cached_tokens == 0
        else:  # the last multiple of I <= old length - 1 (the last token is never fed)
            assert a.num_cached_tokens == (old_len - 1) // I * I
        assert b.num_cached_tokens == 0
        old_len = len(conv) + len(a.outputs[0].token_ids)
        conv = conv + a.outputs[0].token_ids + toks(7 + turn, 10 + turn)
    stats = on.engine.cache_stats()
    assert stats["hits"] == 3 and stats["queries"] == 4


def test_shared_system_prompt_learns_a_divergence_snapshot(pair):
    on, off = pair
    system = toks(37, 2)  # ends mid-block: the shared part is 2 blocks (32 tokens)
    # long user parts: each prompt's own snapshots (prompt end, latest) lie beyond block 2
    users = [toks(n, 20 + n) for n in (30, 27, 40, 33)]
    hits = []
    for u in users:
        a = run_checked(on, [system + u], [GREEDY])[0]
        b = run_checked(off, [system + u], [GREEDY])[0]
        assert_same([a], [b])
        hits.append(a.num_cached_tokens)
    # 1st: nothing cached; 2nd: finds the blocks of the 1st but no snapshot inside the shared
    # part, so it snapshots the divergence point; 3rd and 4th hit there
    assert hits == [0, 0, 32, 32]
    # sampled logprobs too, with a seed
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    a = run_checked(on, [system + users[0]], [sp])[0]
    b = run_checked(off, [system + users[0]], [sp])[0]
    assert a.num_cached_tokens >= 32
    assert_same([a], [b])


def test_repeated_prompt_hits_its_prompt_snapshot(pair):
    on, off = pair
    prompt = toks(45, 7)
    outs = [run_checked(on, [prompt], [GREEDY])[0] for _ in range(3)]
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]  # (45 - 1) // 16 * 16
    assert_same(outs[1:], run_checked(off, [prompt, prompt], [GREEDY, GREEDY]))


def test_prompt_logprobs_requests_recompute_the_prefix(pair):
    on, off = pair
    prompt = toks(45, 8)
    run_checked(on, [prompt], [GREEDY])  # caches a snapshot at 32
    sp = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    a = run_checked(on, [prompt], [sp])[0]
    b = run_checked(off, [prompt], [sp])[0]
    assert a.num_cached_tokens == 0 and len(a.prompt_logprobs) == len(prompt)
    for da, db, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], prompt[1:]):
        assert abs(da[t] - db[t]) < 1e-4
    assert run_checked(on, [prompt], [GREEDY])[0].num_cached_tokens == 32


def test_concurrent_batches_with_shared_prefixes(pair):
    """Random shared-prefix workload, several requests in flight per step (mixed batches)."""
    on, off = pair
    rng = random.Random(0)
    prefixes = [toks(n, 100 + n) for n in (20, 33, 48)]
    for round_ in range(3):
        prompts, params = [], []
        for i in range(6):
            p = rng.choice(prefixes) + toks(rng.randint(1, 25), 1000 * round_ + i)
            prompts.append(p)
            params.append(SamplingParams(temperature=rng.choice([0, 0.7]), seed=i,
                                         max_tokens=rng.randint(3, 20), ignore_eos=True,
                                         logprobs=1))
        a = run_checked(on, prompts, params)
        b = run_checked(off, prompts, params)
        assert_same(a, b)
    stats = on.engine.cache_stats()
    assert stats["hit_tokens"] > 0 and stats["snapshots"] > 0
    assert on.engine.stats["mixed_steps"] > 0


@pytest.mark.parametrize("salts", [(None,), (None, "x", "y")])
def test_eviction_under_a_small_budget(tiny_ckpt, salts):
    probe = LLM(tiny_ckpt, max_num_seqs=1).engine
    slot_b = StatePool.bytes_per_slot(probe.model_config, probe.dtype, probe.ssm_dtype)
    page_b = KVPool.bytes_per_page(probe.model_config, 16, probe.dtype)
    budget = 2 * 6 * slot_b  # 6 slots for up to 2 running requests and their snapshots
    on = LLM(tiny_ckpt, enable_prefix_caching=True, memory_budget_bytes=budget,
             max_num_seqs=2, max_model_len=128, chunked_prefill_size=24)
    off = LLM(tiny_ckpt, max_num_seqs=2, max_model_len=128, chunked_prefill_size=24)
    assert on.engine.state_pool.num_slots == 6
    assert on.engine.kv_pool.num_pages * page_b <= budget
    rng = random.Random(1)
    prefixes = [toks(n, 200 + n) for n in (17, 34, 40, 51)]
    for round_ in range(4):
        prompts = [rng.choice(prefixes) + toks(rng.randint(1, 12), 50 * round_ + i)
                   for i in range(5)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 16), ignore_eos=True,
                                 logprobs=1) for _ in prompts]
        salt = [rng.choice(salts) if len(salts) > 1 else None for _ in prompts]
        assert_same(run_checked(on, prompts, params, salt), run_checked(off, prompts, params))
    stats = on.engine.cache_stats()
    assert stats["evicted_snapshots"] > 0 and stats["hit_tokens"] > 0
    # with everything finished, only the tree holds slots and pages
    on.engine.prefix_cache.evict(slots=on.engine.state_pool.num_slots,
                                 pages=on.engine.kv_pool.num_pages)
    assert on.engine.state_pool.num_free == on.engine.state_pool.num_slots
    assert on.engine.kv_pool.num_free == on.engine.kv_pool.num_pages


def test_cache_salt_isolates_prefixes(pair):
    """vLLM's cache_salt: a prompt hits only entries cached under the same salt (unsalted only
    unsalted ones); outputs are the same hit or miss, and the same as without caching (where
    the salt is accepted and changes nothing)."""
    on, off = pair
    prompt = toks(45, 9)
    ref = run_checked(off, [prompt], [GREEDY], ["a"])[0]
    assert ref.num_cached_tokens == 0
    order = ["a", "b", None, "a", "b", None, "a "]
    hits = []
    for salt in order:
        out = run_checked(on, [prompt], [GREEDY], [salt])[0]
        assert_same([out], [ref])
        hits.append(out.num_cached_tokens)
    assert hits == [0, 0, 0, 32, 32, 32, 0]  # (45 - 1) // 16 * 16 on each salt's repeat
    stats = on.engine.cache_stats()
    assert (stats["queries"], stats["hits"], stats["hit_tokens"]) == (7, 3, 96)
    # a follow-up turn reuses its conversation's snapshots under its own salt only
    turn2 = prompt + ref.outputs[0].token_ids + toks(9, 19)
    assert [run_checked(on, [turn2], [GREEDY], [s])[0].num_cached_tokens
            for s in ("c", "b")] == [0, 48]


def test_n_completions_and_prompt_dicts_carry_the_salt(tiny_ckpt):
    llm = LLM(tiny_ckpt, enable_prefix_caching=True, chunked_prefill_size=24, max_num_seqs=4)
    tree = llm.engine.prefix_cache
    prompt = toks(45, 11)
    sp = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt, "cache_salt": "t1"}, sp)
    llm.engine.check_integrity()
    # every completion of the request inserted under its salt: no unsalted entry
    assert {n.key[0] for n in tree.root.children.values()} == {"t1"}
    outs = llm.generate([{"prompt_token_ids": prompt, "cache_salt": s} for s in ("t2", "t1")]
                        + [prompt], GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 32, 0]
    # vLLM's TextPrompt shape takes a salt too; its text is tokenized like a string prompt
    text = "a prompt of more than thirty-three characters, salted"
    outs = [llm.generate(p, GREEDY)[0] for p in ({"prompt": text, "cache_salt": "t3"}, text,
                                                 {"prompt": text, "cache_salt": "t3"})]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids
    assert [o.num_cached_tokens for o in outs] == [0, 0, 48]
    assert_same(outs, [outs[1]] * 3)


@pytest.mark.parametrize("salt, got", [("", "an empty string"), (5, "int"), (["a"], "list")])
def test_bad_cache_salt_is_refused_before_anything_is_queued(tiny_ckpt, salt, got):
    llm = LLM(tiny_ckpt, enable_prefix_caching=True)
    prompts = [toks(20, 1), {"prompt_token_ids": toks(20, 2), "cache_salt": salt}]
    with pytest.raises(ValueError, match=f"'cache_salt' must be a non-empty string, got {got}"):
        llm.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match="'cache_salt' must be a non-empty string"):
        llm.engine.add_request("r", prompts[1], GREEDY)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_abort_keeps_the_cache_consistent(tiny_ckpt):
    on = LLM(tiny_ckpt, enable_prefix_caching=True, chunked_prefill_size=16, max_num_seqs=3)
    eng = on.engine
    base = toks(40, 3)
    run_checked(on, [base], [GREEDY])
    for i in range(3):
        eng.add_request(f"a{i}", {"prompt_token_ids": base + toks(20, 30 + i)},
                        SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
        eng.check_integrity()
    for i in range(3):
        eng.abort_request(f"a{i}")
        eng.check_integrity()
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("interval, match", [(12, "multiple of the model's SSD chunk size"),
                                             (8, "multiple of the KV page size")])
def test_bad_snapshot_interval(tiny_ckpt, interval, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_ckpt, enable_prefix_caching=True, mamba_snapshot_interval=interval)


def test_warmup_leaves_no_trace(tiny_ckpt):
    """The engine's warm-up (run at start on CUDA) goes through prefill, mixed and decode steps
    but leaves the pools idle, the prefix cache empty and the stats at zero; outputs after it
    are the same as without it."""
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, logprobs=2)]  # no seed
    prompts = [toks(40, 1), toks(19, 2)]
    cold = LLM(tiny_ckpt, enable_prefix_caching=True)
    warm = LLM(tiny_ckpt, enable_prefix_caching=True)
    eng = warm.engine
    free = (eng.state_pool.num_free, eng.kv_pool.num_free)
    steps = []
    step = eng.step
    eng.step = lambda: (steps.append(1), step())[1]
    eng.warmup()
    eng.step = step
    assert len(steps) >= 3 and eng.stats == dict.fromkeys(eng.stats, 0)
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == free
    assert eng.cache_stats()["queries"] == 0 and eng.cache_stats()["snapshots"] == 0
    assert not eng.requests and not eng.has_unfinished_requests()
    eng.check_integrity()
    assert_same(run_checked(warm, prompts, params), run_checked(cold, prompts, params))
