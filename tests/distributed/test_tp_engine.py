"""The engine at tensor_parallel_size 2 (rank 0 here, rank 1 a spawned worker, gloo, float32)
against the same engine at one rank: prompt logprobs within 1e-5 and identical tokens through
chunked prefill, mixed batches, prefix-cache hits, n > 1 seeded sampling and an abort; the
decode and small prefill / mixed steps take the static-buffer graph paths (uncaptured on a CPU)
under overlap scheduling;
per-rank memory; the sync audit on both ranks; a worker that raises or dies makes the engine fail
with an error naming it, within seconds. The other families: test_tp_families.py."""

from __future__ import annotations

import math
import multiprocessing
import time

import pytest
from tp_harness import BASE, assert_same, make_engine, prompts, run

from mambaserve.config import EngineConfig
from mambaserve.distributed.launcher import TPWorkerError
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def _bounded_collectives():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAMBASERVE_TP_TIMEOUT_S", "60")  # a stuck collective raises within 60 s
        yield


@pytest.fixture(scope="class")
def pair(tiny_ckpt):
    """(tp=2 engine: prefix caching, decode and small prefill / mixed steps on the graph paths,
    overlap scheduling; tp=1 engine: prefix caching, eager, synchronous). Class-scoped: one
    tensor-parallel engine per process, so it is closed before the tests below build theirs."""
    tp2 = make_engine(tiny_ckpt, 2, enable_prefix_caching=True, enforce_eager=False,
                      async_scheduling=True, cuda_graph_max_prefill_tokens=256)
    graphs = tp2.runner.prefill_graph_runner
    plan, graphs.planned = graphs.plan, 0  # counts the steps that replay a prefill graph

    def counting(batch):
        graphs.planned += 1
        return plan(batch)

    graphs.plan = counting
    tp1 = make_engine(tiny_ckpt, 1, enable_prefix_caching=True)
    yield tp2, tp1
    tp2.close()


class TestAgainstOneRank:
    def test_greedy_and_prompt_logprobs_match_one_rank(self, pair):
        tp2, tp1 = pair
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=2,
                                logprobs=2)
        reqs = [(f"g{i}", ids, params) for i, ids in enumerate(prompts(4, [53, 9, 30, 17], 1))]
        before = dict(tp2.stats)
        got, want = run(tp2, reqs), run(tp1, reqs)
        assert_same(got, want)
        assert tp2.stats["chunked_prefills"] > before["chunked_prefills"]
        assert tp2.stats["mixed_steps"] > before["mixed_steps"]

    def test_prefix_cache_hits_match_one_rank(self, pair):
        tp2, tp1 = pair
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        (shared,) = prompts(1, [40], 2)
        tails = prompts(2, [7, 12], 3)
        for engine in pair:  # the shared prefix first, then two requests extending it
            run(engine, [("p0", shared, params)])
        hits = tp2.cache_stats()["hit_tokens"]
        reqs = [(f"p{i + 1}", shared + t, params) for i, t in enumerate(tails)]
        got, want = run(tp2, reqs), run(tp1, reqs)
        assert_same(got, want)
        assert all(o.num_cached_tokens > 0 for o in got.values())
        assert tp2.cache_stats()["hit_tokens"] > hits
        assert tp2.runner.prefill_graph_runner.planned > 0  # suffixes through prefill graphs

    def test_seeded_sampling_n2_matches_one_rank(self, pair):
        params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, max_tokens=8, n=2, seed=7,
                                ignore_eos=True, logprobs=1, presence_penalty=0.5)
        reqs = [(f"s{i}", ids, params) for i, ids in enumerate(prompts(2, [21, 11], 4))]
        got, want = run(pair[0], reqs), run(pair[1], reqs)
        assert_same(got, want)
        assert got["s0"].outputs[0].token_ids != got["s0"].outputs[1].token_ids

    def test_abort_of_a_running_request(self, pair):
        tp2, tp1 = pair
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        a, b = prompts(2, [26, 13], 5)
        got = run(tp2, [("a", a, params), ("b", b, params)], abort=("a", 3))
        want = run(tp1, [("b", b, params)])
        assert "a" not in got
        assert got["b"].outputs[0].token_ids == want["b"].outputs[0].token_ids
        assert not tp2.has_unfinished_requests()  # (_run checked the pools' integrity)

    def test_memory_report_per_rank(self, pair):
        tp2, tp1 = pair
        one, two = tp1.memory_report(), tp2.memory_report()
        assert two["tensor_parallel_size"] == 2 and [r["tp_rank"] for r in two["ranks"]] == [0, 1]
        for r in two["ranks"]:
            # every Mamba head, attention KV head and state channel is split in half
            assert r["state_slots"] == one["state_slots"] and r["kv_pages"] == one["kv_pages"]
            assert 2 * r["state_bytes"] == one["state_bytes"]
            assert 2 * r["kv_bytes"] == one["kv_bytes"]
            # every expert's intermediate columns are split in half (per-expert tensor parallel)
            assert 2 * r["expert_weight_bytes"] == one["expert_weight_bytes"]
            assert r["weight_bytes"] < one["weight_bytes"]
        assert two["ranks"][0]["weight_bytes"] == two["weight_bytes"]

    def test_sync_audit_holds_on_both_ranks(self, pair):
        """Last in the class: it leaves requests of its own in the engine's prefix cache."""
        from mambaserve.tools.audit_scenarios import run_scenarios

        results = run_scenarios(pair[0])
        for name, r in results.items():
            assert r.forwards and r.ok and 1 in r.worker_syncs, (name, r)


def test_random_weights_from_a_config_alone_at_two_ranks(tiny_ckpt, tmp_path):
    """load_format="dummy" at tensor_parallel_size 2 (each rank draws only its shard, the way a
    preset larger than one GPU loads): the engine serves greedy requests from config.json alone,
    with finite logprobs, and each rank holds half the state and less than the whole weights."""
    import shutil

    folder = tmp_path / "cfg"
    folder.mkdir()
    shutil.copy(tiny_ckpt / "config.json", folder / "config.json")
    engine = make_engine(folder, 2, load_format="dummy")
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        reqs = [(f"d{i}", ids, params) for i, ids in enumerate(prompts(2, [21, 8], 3))]
        outs = run(engine, reqs)
        assert len(outs) == 2
        for out in outs.values():
            (c,) = out.outputs
            assert len(c.token_ids) == 6 and math.isfinite(c.cumulative_logprob)
        report = engine.memory_report()
    finally:
        engine.close()
    with make_engine(tiny_ckpt, 1) as one:
        whole = one.memory_report()
    assert [r["tp_rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        assert 2 * r["state_bytes"] == whole["state_bytes"]
        assert r["weight_bytes"] < whole["weight_bytes"]


def test_sync_audit_sees_a_sync_on_rank_1(tiny_ckpt):
    from mambaserve.tools.audit_scenarios import run_scenarios

    engine = LLMEngine(tiny_ckpt, EngineConfig(**BASE, tensor_parallel_size=2),
                       _tp_fault=(1, 2, "sync"))
    try:
        results = run_scenarios(engine)
    finally:
        engine.close()
    bad = {k: r for k, r in results.items() if not r.ok}
    assert len(bad) >= 1 and all(r.worker_syncs[1] == 1 for r in bad.values())
    assert all(r.forward_syncs == 0 for r in results.values())  # rank 0 stays clean
    (site,) = {s for r in bad.values() for s in r.sites if s.startswith("(rank 1)")}
    assert site.startswith("(rank 1) [forward] _local_scalar_dense") and "worker.py" in site


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_a_dead_rank_fails_loudly(tiny_ckpt, kind):
    engine = LLMEngine(tiny_ckpt, EngineConfig(**BASE, tensor_parallel_size=2),
                       _tp_fault=(1, 3, kind))
    worker = engine.tp_workers.procs[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError, match="tensor-parallel rank 1 died") as err:
        run(engine, [("x", prompts(1, [30], 6)[0], params)])
    assert time.monotonic() - t0 < 30
    if kind == "raise":
        assert "injected fault on rank 1 at step 3" in str(err.value)
    else:
        assert "exit code 3" in str(err.value)
    with pytest.raises(RuntimeError):  # the engine stays failed
        engine.step()
    engine.close()
    assert not worker.is_alive() and worker not in multiprocessing.active_children()

