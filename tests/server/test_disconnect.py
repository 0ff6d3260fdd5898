"""A client that goes away cancels its request (state slot and KV pages come back), and
SIGTERM drains: requests in flight finish, then the process exits cleanly."""

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

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # ~minutes if not aborted


def _aborts(server) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("mambaserve_requests_finished_total") and "abort" in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError


def _assert_idle(server) -> None:
    p = server.wait_idle(timeout=15)
    assert p["running"] == 0 and p["waiting"] == 0 and p["requests"] == 0, p
    assert p["free_slots"] == p["slots"] and p["free_pages"] == p["pages"], p


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "never ending"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}], "n": 2}),
])
def test_disconnect_mid_stream_frees_the_request(server, path, body):
    before = _aborts(server)
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=30) as c, \
            c.stream("POST", path, json={**body, **LONG, "stream": True}) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    assert server.pools()["running"] >= 1  # generating while we read
                if seen == 4:
                    break  # (leaving iter_lines early already closes the connection)
    _assert_idle(server)
    assert time.monotonic() - t0 < 20
    time.sleep(0.1)
    assert _aborts(server) >= before + 1
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_while_waiting_for_a_non_streamed_response(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "patience", **LONG},
                   timeout=httpx.Timeout(30, read=0.5))
    _assert_idle(server)
    # and the server still answers
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200


@pytest.mark.slow
def test_sigterm_drains_requests_in_flight(tiny_ckpt):
    cmd = [sys.executable, "-m", "mambaserve.cli", "serve", str(tiny_ckpt), "--port", "0",
           "--device", "cpu", "--memory-budget-gb", "0.03", "--log-level", "info"]
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
        threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()

        chunks: list[dict] = []
        first = threading.Event()

        def consume():
            body = {"prompt": "drain me", "max_tokens": 300, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        first.set()
                    elif line == "data: [DONE]":
                        chunks.append({"done": True})

        t = threading.Thread(target=consume)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        # uvicorn re-raises the signal once it has shut down cleanly
        assert proc.wait(60) in (0, -signal.SIGTERM), "".join(log)
        assert "Waiting for connections to close" in "".join(log)
        assert "Application shutdown complete" in "".join(log)
        # the request in flight when SIGTERM came was served to its end
        assert chunks[-1] == {"done": True}
        assert chunks[-2]["usage"]["completion_tokens"] == 300
        assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
