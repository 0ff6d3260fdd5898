"""AsyncEngine: one engine thread, asyncio callers, errors delivered to the right caller."""

from __future__ import annotations

import asyncio

import pytest

from mambaserve import SamplingParams
from mambaserve.config import EngineConfig
from mambaserve.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineStepError,
    QueueFullError,
)
from mambaserve.engine.llm_engine import LLMEngine

BUDGET = 32 << 20  # small pools: allocating the default 1 GiB costs seconds
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def make_engine(ckpt, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(ckpt, EngineConfig(max_num_seqs=max_num_seqs, memory_budget_bytes=BUDGET))


@pytest.fixture(scope="module")
def aengine(tiny_ckpt):
    eng = AsyncEngine(make_engine(tiny_ckpt, 4), max_waiting=None)
    yield eng
    eng.shutdown(drain=False)


def idle(eng: AsyncEngine) -> bool:
    def read(e):
        return (not e.has_unfinished_requests() and not e.requests
                and e.state_pool.num_free == e.state_pool.num_slots
                and e.kv_pool.num_free == e.kv_pool.num_pages)
    return eng.call_sync(read)


async def final(eng, prompt, params, rid=None):
    out = None
    async for out in eng.generate(prompt, params, rid):
        pass
    return out


def test_generate_matches_offline_and_is_cumulative(aengine, tiny_llm):
    prompts = ["ROMEO:", "To be, or not", "a", "The quick brown fox jumps", "xyz", "Hi!"]
    ref = [o.outputs[0].text for o in tiny_llm.generate(prompts, GREEDY)]

    async def main():
        seen = []

        async def one(p):
            outs = [o async for o in aengine.generate(p, GREEDY)]
            seen.append([len(o.outputs[0].token_ids) for o in outs])
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            return outs[-1].outputs[0].text

        texts = await asyncio.gather(*(one(p) for p in prompts))
        return texts, seen

    texts, seen = asyncio.run(main())
    assert texts == ref
    for counts in seen:
        assert counts == sorted(counts) and counts[-1] == 6
    assert idle(aengine)


def test_validation_errors_reach_the_caller(aengine):
    async def main():
        with pytest.raises(ValueError, match="empty prompt"):
            await aengine.add_request(None, {"prompt_token_ids": []}, GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await aengine.add_request(None, [5, 100000], GREEDY)
        # a batch is atomic: one bad prompt queues none of them
        with pytest.raises(ValueError):
            await aengine.add_requests([("ok-1", [5, 6], GREEDY), ("bad-1", [], GREEDY)])
        # the id of the refused batch is free again
        out = await final(aengine, [5, 6], GREEDY, "ok-1")
        assert out.finished

    asyncio.run(main())
    assert idle(aengine)


def test_closing_the_iterator_aborts(aengine):
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)

    async def main():
        gen = aengine.generate("abort me", long, "to-abort")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()

    asyncio.run(main())
    for _ in range(100):
        if idle(aengine):
            break
    assert idle(aengine)


def test_queue_limit(aengine):
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        aengine.max_waiting = 1
        try:
            # 4 seats + 1 waiting place: of 8 requests sent at once, at least 3 are refused
            results = await asyncio.gather(*(final(aengine, f"q{i}", long) for i in range(8)),
                                           return_exceptions=True)
        finally:
            aengine.max_waiting = None
        return results

    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QueueFullError)]
    done = [r for r in results if not isinstance(r, BaseException)]
    assert len(refused) >= 3 and len(done) >= 4 and len(refused) + len(done) == 8
    assert idle(aengine)


def test_a_failing_step_fails_requests_in_flight_and_keeps_serving(aengine):
    engine = aengine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real_step()

    async def main():
        engine.step = flaky_step
        try:
            results = await asyncio.gather(*(final(aengine, f"f{i}", GREEDY) for i in range(3)),
                                           return_exceptions=True)
        finally:
            engine.step = real_step
        assert all(isinstance(r, EngineStepError) for r in results), results
        assert "boom" in str(results[0])
        # the loop still serves
        out = await final(aengine, "after", GREEDY)
        assert out.finished and len(out.outputs[0].token_ids) == 6

    asyncio.run(main())
    assert aengine.step_errors >= 1
    assert idle(aengine)


def test_shutdown_drains_then_refuses(tiny_ckpt):
    eng = AsyncEngine(make_engine(tiny_ckpt, 2))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(final(eng, "drain me", params))
        await asyncio.sleep(0.05)
        assert await eng.ashutdown(drain=True)
        out = await task
        assert out.outputs[0].finish_reason == "length"
        assert len(out.outputs[0].token_ids) == 12
        with pytest.raises(EngineClosedError):
            await eng.add_request(None, "late", params)

    asyncio.run(main())
    assert not eng.is_running


def test_shutdown_without_drain_aborts(tiny_ckpt):
    eng = AsyncEngine(make_engine(tiny_ckpt, 2))
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(final(eng, "abort me", params))
        await asyncio.sleep(0.3)
        assert await eng.ashutdown(drain=False)
        out = await task
        assert out.finished and out.outputs[0].finish_reason == "abort"

    asyncio.run(main())


def test_step_observer_sees_each_kind_and_slow_steps_are_logged(tiny_ckpt, caplog):
    """Every engine step reaches the observer as (kind, seconds); a step over `slow_step_s` is
    logged with its composition (the evidence for JIT-compile or oversized-chunk stalls)."""

    class Steps:
        def __init__(self):
            self.seen = []

        def on_step(self, kind, seconds):
            self.seen.append((kind, seconds))

    obs = Steps()
    eng = AsyncEngine(make_engine(tiny_ckpt, 4), max_waiting=None, observer=obs)
    eng.slow_step_s = 0.0  # every step counts as slow
    try:
        async def main():
            first = asyncio.ensure_future(final(eng, "To be, or not to be", GREEDY))
            while not eng.call_sync(lambda e: e.stats["decode_rows"]):  # first one decoding
                await asyncio.sleep(0.001)
            second = await final(eng, "ROMEO:", GREEDY)
            return await first, second

        with caplog.at_level("WARNING", logger="mambaserve"):
            asyncio.run(main())
    finally:
        eng.shutdown(drain=False)
    kinds = {k for k, _ in obs.seen}
    assert {"prefill", "decode"} <= kinds and all(s > 0 for _, s in obs.seen)
    assert len(obs.seen) == eng.engine.stats["steps"]
    assert "mixed" in kinds or eng.engine.stats["mixed_steps"] == 0
    assert any("slow engine step" in r.getMessage() and "prefill tokens" in r.getMessage()
               for r in caplog.records)


def test_engine_accessors_count_sequences(tiny_ckpt):
    """LLMEngine's read-only views (what AsyncEngine and the server read) through one request
    of n=2 and one of n=1 on a 2-seat engine."""
    eng = make_engine(tiny_ckpt, 2)
    assert (eng.num_running, eng.num_waiting, eng.unfinished_request_ids()) == (0, 0, [])
    eng.add_request("pair", [5, 6], SamplingParams(n=2, temperature=0.0, max_tokens=3))
    eng.add_request("one", [7], SamplingParams(temperature=0.0, max_tokens=3))
    assert (eng.num_running, eng.num_waiting) == (0, 3)
    assert eng.sequences_of("pair") == 2 and eng.sequences_of("one") == 1
    assert eng.sequences_of("nope") == 0
    assert eng.unfinished_request_ids() == ["pair", "one"]
    eng.step()
    assert (eng.num_running, eng.num_waiting) == (2, 1)  # both seats taken by the pair
    assert eng.abort_request("one")
    assert eng.num_waiting == 0 and eng.unfinished_request_ids() == ["pair"]
    while eng.has_unfinished_requests():
        eng.step()
    assert (eng.num_running, eng.sequences_of("pair"), eng.unfinished_request_ids()) == (0, 0, [])


def test_async_engine_exposes_config_and_memory(aengine):
    assert aengine.model_config is aengine.engine.model_config
    assert aengine.max_model_len == aengine.model_config.max_position_embeddings
    mem = aengine.memory_report()
    assert mem["state_slots"] == 4 and mem["kv_pages"] >= 1
    assert mem["kv_bytes"] + mem["state_bytes"] <= BUDGET


def test_prompt_errors_have_one_message(tiny_ckpt, aengine):
    """LLMEngine.validate_prompt: the checks of add_request, without queuing anything."""
    eng = aengine.engine
    assert eng.validate_prompt({"prompt_token_ids": [5, 6], "prompt": "hi"}) == ("hi", [5, 6])
    assert eng.validate_prompt("ab") == ("ab", eng.tokenizer.encode("ab"))
    too_long = [5] * aengine.max_model_len
    with pytest.raises(ValueError, match=r"prompt has 4096 tokens; the model's limit \(maximum "
                                         r"context length\) is 4096 tokens"):
        eng.validate_prompt(too_long)
    assert idle(aengine)
