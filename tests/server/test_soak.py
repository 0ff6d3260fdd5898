"""The soak of soak.py, short: 32 clients for 30 s (MAMBASERVE_SOAK_S to change it) mixing
streams, disconnects, aborts and bad requests against the shared server. Afterwards no request
failed, nothing was logged at ERROR, the pools are back at idle, check_integrity() holds and the
process' RSS grew little after its warm-up."""

from __future__ import annotations

import asyncio
import os

import pytest

httpx = pytest.importorskip("httpx")

from soak import ErrorLogs, pools_idle, rss_mb, run_soak  # noqa: E402

DURATION_S = float(os.environ.get("MAMBASERVE_SOAK_S", "30"))
RSS_GROWTH_MB = 64  # after the first third of the run


@pytest.mark.slow
def test_soak(server):
    with ErrorLogs() as errors:
        report = asyncio.run(run_soak(server.url, DURATION_S, clients=32, seed=7))
    print({k: report[k] for k in ("total", "requests", "status", "rss_mb")})
    assert report["failures"] == [], report["failures"][:10]
    assert errors.records == [], errors.records[:10]
    reqs, status = report["requests"], report["status"]
    # every kind ran, and the answers were the ones each kind must get
    assert set(reqs) == {"plain", "stream", "chat", "n2", "disconnect", "give_up", "bad"}, reqs
    assert report["total"] >= 100 and not any(s.startswith("5") for s in status), status
    pools = pools_idle(server.engine)
    assert pools["idle"] and pools["integrity"] == "ok", pools
    samples = report["rss_mb"]
    warm = samples[max(1, len(samples) // 3)]
    assert rss_mb() - warm < RSS_GROWTH_MB, samples
    assert httpx.get(server.url + "/health").status_code == 200
    # the server still gives exactly what it should
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": "after", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
