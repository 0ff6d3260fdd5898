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
