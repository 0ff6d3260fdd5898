"""Overlap scheduling on the CPU: the very same step loop as on a GPU (step N+1 is scheduled and
launched before step N's tokens are applied; decode rows take their input token from the device
buffer), so the one-step lag is exercised while the results must equal the synchronous order."""

from dataclasses import dataclass

import pytest
import torch

from mambaserve import LLM, SamplingParams


def toks(n, seed):
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(llm: LLM, prompts, params, abort_after: dict | None = None):
    """Step by step with an integrity check after every step; `abort_after` {request: step}.
    Returns ({request id: final output}, the number of rows that fed a token from the device,
    the number of decode rows run)."""
    eng, rows = llm.engine, {"device": 0, "decode": 0}

    def count(batch, meta):
        rows["device"] += sum(r.input_on_device for r in batch.rows)
        rows["decode"] += len(batch.decodes)

    eng.runner.on_forward = count
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    done, step = {}, 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        for rid, at in (abort_after or {}).items():
            if at == step and rid not in done:
                out = eng.output_of(rid)
                assert eng.abort_request(rid)
                done[rid] = out
        eng.check_integrity()
    eng.runner.on_forward = None
    assert eng.state_pool.num_free == eng.state_pool.num_slots - (
        eng.prefix_cache.num_snapshots if eng.prefix_cache else 0)
    if eng.prefix_cache is None:
        assert eng.kv_pool.num_free == eng.kv_pool.num_pages
    return done, rows["device"], rows["decode"]


def same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason), rid
            # the batches differ by the rows run past a stop, and a CPU matmul's rounding
            # depends on its shape: logprobs agree to float rounding, tokens exactly
            close(x.logprobs, y.logprobs)
            assert (x.cumulative_logprob is None) == (y.cumulative_logprob is None)
            if x.cumulative_logprob is not None:
                assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
        close(a[rid].prompt_logprobs, b[rid].prompt_logprobs)


def close(xs, ys):
    assert (xs is None) == (ys is None)
    for dx, dy in zip(xs or [], ys or [], strict=True):
        assert (dx is None) == (dy is None)
        if dx is not None:
            assert dx.keys() == dy.keys()
            assert all(abs(dx[k] - dy[k]) < 1e-4 for k in dx)


def workload():
    """Greedy and seeded requests, chunked prompts (mixed batches), n > 1, logprobs, prompt
    logprobs, stop strings, stop token ids, EOS, min_tokens."""
    prompts = [toks(n, s) for s, n in enumerate([40, 7, 23, 3, 31, 12, 50, 9])]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=15, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=9, n=3),
        SamplingParams(temperature=1.0, seed=11, max_tokens=30, stop=["e", "a"]),
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, logprobs=0),
        SamplingParams(temperature=1.0, seed=5, max_tokens=25, stop_token_ids=[100, 101, 102,
                                                                                103, 104]),
        SamplingParams(temperature=1.2, top_p=0.9, seed=1, max_tokens=40),  # EOS may stop it
        SamplingParams(temperature=1.0, seed=9, max_tokens=8, min_tokens=4, stop=["o"]),
    ]
    return prompts, params


@pytest.mark.parametrize("prefix", [False, True], ids=["no-cache", "prefix-cache"])
def test_overlap_equals_synchronous_order(tiny_ckpt, prefix):
    prompts, params = workload()
    kw = {"chunked_prefill_size": 24, "max_num_seqs": 6, "enable_prefix_caching": prefix}
    sync, dev_sync, _ = run(LLM(tiny_ckpt, async_scheduling=False, **kw), prompts, params)
    lag_llm = LLM(tiny_ckpt, async_scheduling=True, **kw)
    assert lag_llm.engine.async_scheduling
    lag, dev_lag, _ = run(lag_llm, prompts, params)
    same(sync, lag)
    assert dev_sync == 0 and dev_lag > 20  # the overlapped path fed tokens from the device
    # stop strings, stop ids or EOS ended some requests early: their last row ran and was dropped
    assert any(c.finish_reason == "stop" for o in sync.values() for c in o.outputs)
    # a second round reuses the cache (and the pools) the first left behind
    sync2, _, _ = run(LLM(tiny_ckpt, async_scheduling=False, **kw), prompts[::-1], params[::-1])
    lag2, _, _ = run(lag_llm, prompts[::-1], params[::-1])
    same(sync2, lag2)


def test_token_after_a_stop_is_computed_and_never_shown(tiny_ckpt):
    p = toks(10, 1)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(tiny_ckpt).generate({"prompt_token_ids": p}, free)[0].outputs[0].token_ids
    stop_at = ref[4]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            stop_token_ids=[stop_at])
    sync, _, dec_sync = run(LLM(tiny_ckpt, async_scheduling=False), [p], [params])
    lag, _, dec_lag = run(LLM(tiny_ckpt, async_scheduling=True), [p], [params])
    first = ref.index(stop_at)
    assert sync["r0"].outputs[0].token_ids == ref[: first + 1]
    same(sync, lag)
    assert dec_lag == dec_sync + 1  # one row ran past the stop; its token was discarded


def test_length_limit_schedules_no_row_past_max_tokens(tiny_ckpt):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _, _, dec_sync = run(LLM(tiny_ckpt, async_scheduling=False), [toks(6, 2)], [params])
    lag, _, dec_lag = run(LLM(tiny_ckpt, async_scheduling=True), [toks(6, 2)], [params])
    assert len(lag["r0"].outputs[0].token_ids) == 5
    assert dec_lag == dec_sync == 4


@pytest.mark.parametrize("prefix", [False, True], ids=["no-cache", "prefix-cache"])
def test_aborts_under_the_lag(tiny_ckpt, prefix):
    """Aborted requests free everything once their row in flight ran; the others are
    unaffected; what an aborted request showed is a prefix of its full output."""
    prompts, params = workload()
    kw = {"chunked_prefill_size": 24, "max_num_seqs": 6, "enable_prefix_caching": prefix}
    full, _, _ = run(LLM(tiny_ckpt, async_scheduling=False, **kw), prompts, params)
    aborts = {"r0": 3, "r2": 5, "r6": 9, "r7": 1}
    for mode in (False, True):
        got, _, _ = run(LLM(tiny_ckpt, async_scheduling=mode, **kw), prompts, params, aborts)
        kept = {k: v for k, v in got.items() if k not in aborts}
        same(kept, {k: full[k] for k in kept})
        for rid in aborts:
            for x, y in zip(got[rid].outputs, full[rid].outputs):
                assert y.token_ids[: len(x.token_ids)] == x.token_ids


@dataclass
class HostTokenParams(SamplingParams):
    """Stands in for a constrained request (its token mask depends on its last token)."""

    @property
    def needs_host_token_each_step(self) -> bool:
        return True


def test_requests_that_need_their_last_token_do_not_run_ahead(tiny_ckpt):
    prompts = [toks(9, 4), toks(14, 5)]
    params = [HostTokenParams(temperature=1.0, seed=2, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)]
    sync, _, _ = run(LLM(tiny_ckpt, async_scheduling=False), prompts, params)
    lag_llm = LLM(tiny_ckpt, async_scheduling=True)
    seen = []
    orig = lag_llm.engine.runner.launch

    def launch(batch):
        seen.extend((r.request.request_id, r.input_on_device) for r in batch.rows)
        return orig(batch)

    lag_llm.engine.runner.launch = launch
    lag, _, _ = run(lag_llm, prompts, params)
    same(sync, lag)
    assert not any(dev for rid, dev in seen if rid == "r0")
    assert any(dev for rid, dev in seen if rid == "r1")  # runs ahead once r0 is done


def test_async_scheduling_default_and_flag(tiny_ckpt):
    import argparse

    from mambaserve.config import EngineConfig

    assert LLM(tiny_ckpt, device="cpu").engine.async_scheduling is False  # CPU: off unless asked
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli(parser.parse_args([])).async_scheduling is None
    assert EngineConfig.from_cli(parser.parse_args(["--async-scheduling"])).async_scheduling
    cfg = EngineConfig.from_cli(parser.parse_args(["--no-async-scheduling"]))
    assert cfg.async_scheduling is False


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_step_that_raises_leaves_nothing_in_flight(tiny_ckpt, overlap):
    """After a failing forward (the server then aborts what was running), the pools are idle
    and the engine serves the next request as before. On the CPU: on a GPU the steps replay CUDA
    graphs, which run no Python forward to break."""
    llm = LLM(tiny_ckpt, async_scheduling=overlap, chunked_prefill_size=16, device="cpu")
    eng = llm.engine
    prompts, params = workload()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    for _ in range(4):
        eng.step()
    real = eng.model.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    eng.model.forward = broken
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    eng.model.forward = real
    for rid in eng.unfinished_request_ids():
        eng.abort_request(rid)
    eng.check_integrity()
    assert not eng.has_unfinished_requests()
    assert (eng.state_pool.num_free, eng.kv_pool.num_free) == \
        (eng.state_pool.num_slots, eng.kv_pool.num_pages)
    p = {"prompt_token_ids": toks(12, 3)}
    sp = SamplingParams(temperature=0, max_tokens=5)
    assert llm.generate(p, sp)[0].outputs[0].token_ids == \
        LLM(tiny_ckpt, device="cpu").generate(p, sp)[0].outputs[0].token_ids
