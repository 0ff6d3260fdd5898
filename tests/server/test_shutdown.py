"""Shutdown never answers 500: requests in flight run for up to the drain timeout, then end with
finish_reason "abort" (a plain request gets a 200 with its partial output, a stream a last chunk
and [DONE]); 0 aborts at once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

LONG = {"prompt": "drain", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def _plain(url: str, out: list) -> None:
    r = httpx.post(url + "/v1/completions", json=LONG, timeout=60)
    out.append(("plain", r.status_code, r.headers.get("content-type", ""), r.text))


def _stream(url: str, out: list, started: threading.Event, after_stop: dict) -> None:
    body = {**LONG, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line:
                continue
            lines.append(line)
            started.set()
            if after_stop.get("t") is not None and line.startswith("data: {"):
                after_stop.setdefault("first_tokens", json.loads(line[6:])["usage"]
                                      ["completion_tokens"])
    out.append(("stream", r.status_code, r.headers.get("content-type", ""), lines))


def _check(results: list, n: int) -> list[int]:
    """Every request answered 200 and ended with finish_reason abort; -> tokens per request."""
    assert len(results) == n, results
    tokens = []
    for kind, status, ctype, payload in results:
        assert status == 200, (kind, status, payload if kind == "plain" else payload[-3:])
        if kind == "plain":
            assert ctype.startswith("application/json")
            body = json.loads(payload)
            ch = body["choices"][0]
            assert ch["finish_reason"] == "abort"
            assert body["usage"]["completion_tokens"] > 0 and ch["text"]
            tokens.append(body["usage"]["completion_tokens"])
        else:
            assert ctype.startswith("text/event-stream")
            assert payload[-1] == "data: [DONE]", payload[-3:]
            last = json.loads(payload[-2][6:])
            assert "error" not in last, last
            assert last["choices"][0]["finish_reason"] == "abort"
            tokens.append(last["usage"]["completion_tokens"])
    return tokens


@pytest.mark.parametrize("drain_timeout", [0.0, 0.5, 2.0])
def test_drain_timeout_then_abort(tiny_ckpt, drain_timeout):
    """0: abort at once; 0.5 (a float, not rounded to 0); 2.0: the timeout expires while the
    requests are still generating, which they do until then."""
    from mambaserve.server import ServerThread, build_app

    app, engine = build_app(tiny_ckpt, device="cpu", max_num_seqs=8,
                            memory_budget_bytes=64 << 20, drain_timeout=drain_timeout)
    srv = ServerThread(app).start()
    results: list = []
    started = threading.Event()
    after_stop: dict = {}
    threads = [threading.Thread(target=_plain, args=(srv.url, results)) for _ in range(3)]
    threads += [threading.Thread(target=_stream, args=(srv.url, results, started, after_stop))
                for _ in range(3)]
    try:
        for t in threads:
            t.start()
        assert started.wait(30)
        deadline = time.monotonic() + 30
        while engine.snapshot.running < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.snapshot.running == 6
        tokens_before = engine.call_sync(lambda e: sum(len(c.token_ids) for rid in
                                                       e.unfinished_request_ids()
                                                       for c in e.output_of(rid).outputs))
        t0 = time.monotonic()
        after_stop["t"] = t0
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        for t in threads:
            t.join(30)
        took = time.monotonic() - t0
        stopper.join(30)
        assert not stopper.is_alive() and not srv.thread.is_alive()
    finally:
        if srv.thread.is_alive():
            srv.stop()
    tokens = _check(results, 6)
    assert drain_timeout <= took < drain_timeout + 3, took
    if drain_timeout >= 2:  # they kept generating during the drain
        assert sum(tokens) > tokens_before + 6 * 5, (tokens, tokens_before)
    assert not engine.is_running
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=2)


def test_requests_that_finish_within_the_drain_are_served_whole(tiny_ckpt):
    from mambaserve.server import ServerThread, build_app

    app, engine = build_app(tiny_ckpt, device="cpu", max_num_seqs=4,
                            memory_budget_bytes=64 << 20, drain_timeout=20)
    srv = ServerThread(app).start()
    out: list = []
    body = {"prompt": "short", "max_tokens": 40, "ignore_eos": True}
    t = threading.Thread(target=lambda: out.append(
        httpx.post(srv.url + "/v1/completions", json=body, timeout=60)))
    t.start()
    deadline = time.monotonic() + 30
    while engine.snapshot.running < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    srv.stop()
    t.join(30)
    r = out[0]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 40


@pytest.mark.slow
def test_sigterm_with_a_short_drain_timeout_answers_every_request(tiny_ckpt):
    """The real signal path, `--drain-timeout 0.5`: the streams and plain requests in flight
    get finish_reason abort, nothing is answered 500, no ASGI exception is logged."""
    cmd = [sys.executable, "-m", "mambaserve.cli", "serve", str(tiny_ckpt), "--port", "0",
           "--device", "cpu", "--memory-budget-gb", "0.03", "--drain-timeout", "0.5"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]) + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)
    log: list[str] = []
    try:
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            log.append(line)
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", line)
            if m:
                url = m.group(1)
        assert url, "".join(log)
        reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
        reader.start()
        results: list = []
        started = threading.Event()
        threads = [threading.Thread(target=_plain, args=(url, results)) for _ in range(2)]
        threads += [threading.Thread(target=_stream, args=(url, results, started, {}))
                    for _ in range(2)]
        for t in threads:
            t.start()
        assert started.wait(30)
        time.sleep(0.3)  # the plain requests are in too
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 < 5
        assert proc.wait(30) in (0, -signal.SIGTERM)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _check(results, 4)
    text = "".join(log)
    assert "Exception in ASGI application" not in text and " 500 " not in text, text[-3000:]
    assert "drain did not finish in 0.5 s" in text
