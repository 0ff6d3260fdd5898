"""`mambaserve bench serve` against a real server over the tiny checkpoint."""

from __future__ import annotations

import itertools
import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def url(tiny_ckpt):
    from mambaserve.server import ServerThread, build_app

    app, _ = build_app(tiny_ckpt, device="cpu", max_num_seqs=8, memory_budget_bytes=32 << 20)
    with ServerThread(app) as srv:
        yield srv.url


def test_bench_serve_cli_writes_sane_results(url, tmp_path, capsys):
    from mambaserve.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "serve", "--base-url", url, "--dataset", "random", "--input-len", "24",
               "--output-len", "6", "--num-prompts", "10", "--request-rate", "50",
               "--max-concurrency", "4", "--shared-prefix-len", "8", "--out", str(out),
               "--plot", str(png), "--disable-tqdm"])
    assert rc == 0
    assert "output token throughput" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["completed"] == 10 and r["failed"] == 0 and r["errors"] == {}
    assert r["total_input_tokens"] == 240 and r["total_output_tokens"] == 60
    assert r["duration_s"] > 0
    assert r["request_throughput"] == pytest.approx(10 / r["duration_s"])
    assert r["output_throughput"] == pytest.approx(60 / r["duration_s"])
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms"):
        s = r[key]
        assert 0 < s["min"] <= s["median"] <= s["p99"] <= s["max"], (key, s)
        assert s["min"] <= s["mean"] <= s["max"]
    assert r["ttft_ms"]["max"] <= r["e2el_ms"]["max"]
    tl = r["timeline"]
    assert sum(tl["output_tokens_per_s"]) * tl["bin_s"] == pytest.approx(60)
    assert r["config"]["model"] and r["config"]["max_concurrency"] == 4
    if png.exists():  # matplotlib present
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # from the server's /metrics: no preemption on this budget, the device was busy some of
    # the time, the running batch never above max_num_seqs
    srv = r["server"]
    assert srv["preemptions"] == 0
    assert 0 < srv["device_busy_fraction"] <= 1.05 and srv["device_busy_s"] > 0
    assert len(srv["timeline"]["t_s"]) >= 2
    assert all(0 <= x <= 8 for x in srv["timeline"]["running"])
    assert len(tl["itl_median_ms"]) == len(tl["output_tokens_per_s"])
    assert any(v is not None for v in tl["itl_median_ms"])
    assert len(r["output_sha256"]) == 64


def test_bench_all_at_once_and_failures_are_counted(url):
    import asyncio

    from mambaserve.bench.serve import BenchConfig, run_benchmark

    res = asyncio.run(run_benchmark(BenchConfig(base_url=url, input_len=8, output_len=3,
                                                num_prompts=6, disable_tqdm=True)))
    assert res["completed"] == 6 and res["total_output_tokens"] == 18
    # an unknown model: every request fails with the server's 404, the run does not crash
    res = asyncio.run(run_benchmark(BenchConfig(base_url=url, model="nope", vocab_size=300,
                                                input_len=4, output_len=2, num_prompts=3,
                                                disable_tqdm=True)))
    assert res["completed"] == 0 and res["failed"] == 3
    assert any("404" in e for e in res["errors"])


def test_sampled_requests_are_seeded_so_two_runs_compare(url):
    """--temperature / --top-p: every request samples with them and the run's seed, so the
    same run twice gives the same outputs, unlike greedy decoding's."""
    import asyncio

    from mambaserve.bench.serve import BenchConfig, run_benchmark

    def run(**kw):
        res = asyncio.run(run_benchmark(BenchConfig(base_url=url, input_len=8, output_len=6,
                                                    num_prompts=4, disable_tqdm=True, **kw)))
        assert res["completed"] == 4 and res["failed"] == 0
        return res

    a, b = run(temperature=1.5, top_p=0.9), run(temperature=1.5, top_p=0.9)
    assert a["output_sha256"] == b["output_sha256"]
    assert a["config"]["temperature"] == 1.5 and a["config"]["top_p"] == 0.9
    assert run()["output_sha256"] != a["output_sha256"]
    with pytest.raises(ValueError, match="top-p"):
        BenchConfig(top_p=0.0).validate()


def test_poisson_arrivals_and_prompts():
    from mambaserve.bench.serve import BenchConfig, arrival_times, make_prompts

    cfg = BenchConfig(num_prompts=2000, request_rate=10.0, input_len=12, shared_prefix_len=5)
    t = arrival_times(cfg)
    gaps = [b - a for a, b in itertools.pairwise(t)]
    assert t[0] == 0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.1)
    assert arrival_times(BenchConfig(num_prompts=3, request_rate=math.inf)) == [0.0] * 3
    ps = make_prompts(cfg, vocab_size=50)
    assert all(len(p) == 12 and p[:5] == ps[0][:5] and max(p) < 50 for p in ps)
    with pytest.raises(ValueError):
        BenchConfig(shared_prefix_len=200, input_len=10).validate()


def test_metrics_text_is_summed_over_labels():
    from mambaserve.bench.serve_server import parse_metrics

    text = """# HELP x_total help
# TYPE x_total counter
x_total{model_name="m",kind="a"} 2.0
x_total{model_name="m",kind="b"} 3.5
y 7
bad line
"""
    assert parse_metrics(text) == {"x_total": 5.5, "y": 7.0}


def test_ideal_throughput_from_a_one_batch_json(tmp_path):
    from mambaserve.bench.serve_server import ideal_throughput

    def entry(b, n, prefill, step):
        return {"batch_size": b, "input_len": n, "prefill_tokens_per_s": prefill,
                "decode_step_s": step, "decode_steps": [step] * 3 if step else [], "error": ""}

    path = tmp_path / "ob.json"
    path.write_text(json.dumps([entry(1, 2048, 30000.0, 0.009), entry(8, 2048, 35000.0, 0.0),
                                entry(64, 512, 20000.0, 0.0121), entry(32, 512, 1.0, 0.011),
                                {"batch_size": 256, "error": "out of memory"}]))
    ideal = ideal_throughput(path, 1024, 256, 64)
    want = 64 * 256 / (64 * 1024 / 35000.0 + 255 * 0.0121)  # the issue's ~3,300 tok/s
    assert ideal["output_throughput"] == pytest.approx(want) and 3200 < want < 3400
    assert (ideal["decode_batch_size"], ideal["prefill_entry"]) == (64, "8x2048")
    assert ideal_throughput(path, 1024, 256, 40)["decode_batch_size"] == 32  # the nearest
    path.write_text(json.dumps([entry(1, 512, 100.0, 0.0)]))
    with pytest.raises(ValueError, match="decode"):
        ideal_throughput(path, 8, 8, 1)
    with pytest.raises(ValueError, match="cannot read"):
        ideal_throughput(tmp_path / "missing.json", 8, 8, 1)


def test_multiturn_conversations_resend_their_history():
    from mambaserve.bench.serve_multiturn import make_conversations

    system, convs = make_conversations(10, 3, 16, 5, 4, vocab_size=100, seed=1)
    assert len(system) == 16 and len(convs) == 3
    c = convs[0]
    p0, p1, p2 = (c.prompt(system, t) for t in range(3))
    assert p0 == system + c.users[0] and len(p2) == 16 + 3 * 5 + 2 * 4
    assert p1[: len(p0)] == p0 and p2[: len(p1)] == p1  # each turn extends the last
    assert p1[len(p0): len(p0) + 4] == c.replies[0]
    assert convs[1].prompt(system, 0)[:16] == system and convs[1].users != c.users


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_multiturn_with_prefix_caching_on_and_off_gives_the_same_outputs(tiny_ckpt, overlap):
    """The multi-turn workload on two servers: caching on hits (the shared system prompt and the
    history), the answers are the same (one digest), every conversation completes."""
    import asyncio

    from mambaserve.bench.serve import BenchConfig, run_benchmark
    from mambaserve.server import ServerThread, build_app

    runs = {}
    for cache in (False, True):
        app, _ = build_app(tiny_ckpt, device="cpu", max_num_seqs=4, memory_budget_bytes=32 << 20,
                           enable_prefix_caching=cache, async_scheduling=overlap)
        with ServerThread(app) as srv:
            runs[cache] = asyncio.run(run_benchmark(BenchConfig(
                base_url=srv.url, dataset="multiturn", num_prompts=9, num_turns=3,
                shared_prefix_len=40, input_len=6, output_len=5, think_time_s=0.01,
                max_concurrency=2, disable_tqdm=True, metrics_interval_s=0.05)))
    off, on = runs[False], runs[True]
    assert off["completed"] == on["completed"] == 9 and off["failed"] == 0
    assert off["total_output_tokens"] == 45
    assert on["output_sha256"] == off["output_sha256"]
    assert on["server"]["prefix_cache_token_hit_rate"] > 0.3
    assert not off["server"]["prefix_cache_token_hit_rate"]
