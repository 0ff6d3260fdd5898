"""The engine at tensor_parallel_size 2 against one rank for every family besides NemotronH
(test_tp_engine.py), on the tiny checkpoints of tests/family_checkpoints.py (gloo, float32):
prompt logprobs and sampled logprobs within float32's tolerance (tp_harness.close) and identical
greedy tokens, under a 24-token budget (chunked prefills, mixed steps), then prefix-cache hits;
for Mamba2 the sync audit's scenarios on both ranks. One tensor-parallel engine per family
serves every check (spawning a rank costs seconds); it runs decode steps on the static-buffer
graph path (uncaptured on a CPU) under overlap scheduling, the one-rank reference eagerly and in
order.

The cases: Falcon-H1 (attention and Mamba2 in every layer, every multiplier != 1), Bamba,
Mamba2 (no attention layer: a KV pool of no bytes) and the dense GraniteMoeHybrid, all with
n_groups 1 (the gated norm's one group spans both ranks: its sums of squares are all-reduced);
GraniteMoeHybrid with routed experts and n_groups 2 (each rank's group normalized locally)."""

from __future__ import annotations

import multiprocessing

import pytest
from family_checkpoints import (
    GRANITE_DENSE,
    make_tiny_bamba,
    make_tiny_falcon_h1,
    make_tiny_granite_moe_hybrid,
    make_tiny_mamba2,
)
from tp_harness import assert_same, make_engine, prompts, run

from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.tools.audit_scenarios import run_scenarios

# name -> (checkpoint maker, its overrides)
CASES = {
    "falcon_h1_g1": (make_tiny_falcon_h1, {"seed": 2, "mamba_n_groups": 1}),
    "bamba_g1": (make_tiny_bamba, {"seed": 2, "mamba_n_groups": 1}),
    "mamba2_g1": (make_tiny_mamba2, {"seed": 2, "n_groups": 1}),
    "granite_dense_g1": (make_tiny_granite_moe_hybrid, {"seed": 2, "mamba_n_groups": 1,
                                                        **GRANITE_DENSE}),
    "granite_moe_g2": (make_tiny_granite_moe_hybrid, {"seed": 1}),
}
# the sync audit's scenarios on both ranks, zero syncs in every forward (the all-reduce of the
# spanning norm group's sums included); one family is enough (the audit is slow)
AUDITED = {"mamba2_g1"}


@pytest.fixture(scope="module", autouse=True)
def _bounded_collectives():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAMBASERVE_TP_TIMEOUT_S", "60")  # a stuck collective raises within 60 s
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_family_tp2_matches_one_rank(tmp_path, case):
    maker, overrides = CASES[case]
    path = maker(tmp_path / case, **overrides)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2,
                            logprobs=1)
    batch = [(f"g{i}", ids, greedy) for i, ids in enumerate(prompts(4, [45, 9, 30, 17], 8))]
    # a 40-token prefix (two 16-token snapshot blocks), then two requests extending it
    (shared,) = prompts(1, [40], 9)
    cont = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    extended = [(f"p{i + 1}", shared + t, cont) for i, t in enumerate(prompts(2, [7, 12], 10))]

    tp1 = make_engine(path, 1, enable_prefix_caching=True)
    want = [run(tp1, batch), run(tp1, [("p0", shared, cont)]), run(tp1, extended)]
    tp2 = make_engine(path, 2, enable_prefix_caching=True, enforce_eager=False,
                      async_scheduling=True)
    worker = tp2.tp_workers.procs[0]
    try:
        if case.startswith("mamba2"):  # no attention layer: both ranks' KV pools hold no bytes
            assert [r["kv_bytes"] for r in tp2.memory_report()["ranks"]] == [0, 0]
        got = [run(tp2, batch)]
        assert tp2.stats["chunked_prefills"] > 0 and tp2.stats["mixed_steps"] > 0
        got.append(run(tp2, [("p0", shared, cont)]))
        hits = tp2.cache_stats()["hit_tokens"]
        got.append(run(tp2, extended))
        assert all(o.num_cached_tokens >= 32 for o in got[2].values())
        assert tp2.cache_stats()["hit_tokens"] > hits
        if case in AUDITED:  # last: the audit's requests stay in the prefix cache
            for name, r in run_scenarios(tp2).items():
                assert r.forwards and r.ok and r.worker_syncs == {1: 0}, (name, r)
    finally:
        tp2.close()
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    # close() stopped the worker cleanly: it left its loop and exited 0, and was reaped
    assert worker.exitcode == 0 and worker not in multiprocessing.active_children()
    with pytest.raises(RuntimeError, match="closed"):
        tp2.step()
