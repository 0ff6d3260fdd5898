"""vLLM's request `priority` on /v1/completions and /v1/chat/completions: an integer (else a
400 naming it); under the default fcfs policy anything but 0 is refused with a 400 (never
queued); under `scheduling_policy="priority"` it is served and orders the waiting queue."""

from __future__ import annotations

import threading
import time

import pytest
from conftest import module_server

httpx = pytest.importorskip("httpx")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _body(path, **kw):
    body = {"prompt": [5, 6, 7, 8]} if path == CMPL else \
        {"messages": [{"role": "user", "content": "Hello there"}]}
    body.update({"max_tokens": 3, "temperature": 0, **kw})
    return body


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("stream", [False, True])
def test_fcfs_refuses_a_priority_other_than_0(server, path, stream):
    before = server.engine.call_sync(lambda e: e.scheduler.num_preemptions)
    for prio in (3, -1):
        err = _post(server, path, _body(path, priority=prio, stream=stream), 400)["error"]
        assert err["param"] == "priority" and err["code"] == "invalid_value"
        assert err["type"] == "invalid_request_error" and "\n" not in err["message"]
        assert err["message"].startswith(f"got priority {prio} but priority scheduling is not "
                                         "enabled: start the engine with ")
    for prio in (0, None):  # 0 (vLLM's default) and null are served
        assert _post(server, path, _body(path, priority=prio))["choices"]
    assert server.wait_idle()["requests"] == 0
    assert server.engine.call_sync(lambda e: e.scheduler.num_preemptions) == before


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("prio, want", [("1", "got string '1'"), (1.5, "got number 1.5"),
                                        (True, "got boolean true"), ([1], "got an array")])
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(server, path, prio, want):
    err = _post(server, path, _body(path, priority=prio), 400)["error"]
    assert err["param"] == "priority" and err["code"] == "invalid_type"
    assert err["message"] == f"'priority' must be an integer, {want}"


prio_server = module_server(scheduling_policy="priority", max_num_seqs=1,
                            memory_budget_bytes=32 << 20)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_priority_policy_serves_priorities_and_passes_them_on(prio_server, path):
    eng = prio_server.engine.engine
    seen = []
    add = eng.add_request

    def spy(request_id, prompt, params=None, priority=0):
        seen.append((params.n, priority))
        return add(request_id, prompt, params, priority=priority)

    eng.add_request = spy
    try:
        ref = _post(prio_server, path, _body(path))
        out = _post(prio_server, path, _body(path, priority=-4, n=2))
        assert _post(prio_server, path, _body(path, priority=2**63 - 1))["choices"]
    finally:
        del eng.add_request
    assert seen == [(1, 0), (2, -4), (1, 2**63 - 1)]
    key = "text" if path == CMPL else "message"
    assert [c[key] for c in out["choices"]] == [ref["choices"][0][key]] * 2
    err = _post(prio_server, path, _body(path, priority=2**63), 400)["error"]
    assert err["param"] == "priority" and err["code"] == "invalid_value"
    assert err["message"] == f"'priority' must be <= {2**63 - 1}, got {2**63}"


def test_the_higher_priority_is_admitted_first(prio_server):
    """Two requests reach the engine in one batch of commands (its thread held meanwhile), the
    low priority first; with one seat the high priority one runs, the other waits."""
    aengine = prio_server.engine
    started, release = threading.Event(), threading.Event()

    def hold(e):
        started.set()
        release.wait(10)

    held = threading.Thread(target=aengine.call_sync, args=(hold,))
    held.start()
    assert started.wait(10)  # the engine thread is in hold(): commands pile up meanwhile
    results = {}

    def send(prio):
        results[prio] = _post(prio_server, CMPL, _body(CMPL, priority=prio, max_tokens=6))

    senders = []
    try:
        for prio in (5, -5):  # arrival order: low priority first
            n = len(aengine._commands)
            senders.append(threading.Thread(target=send, args=(prio,)))
            senders[-1].start()
            deadline = time.monotonic() + 10
            while len(aengine._commands) == n and time.monotonic() < deadline:
                time.sleep(0.005)
            assert len(aengine._commands) == n + 1  # queued behind the held engine thread
    finally:
        release.set()
        held.join()

    def snapshot(e):
        return ([r.priority for r in e.scheduler.running],
                [r.priority for r in e.scheduler.waiting])

    deadline = time.monotonic() + 10
    while not (seen := aengine.call_sync(snapshot))[0] and time.monotonic() < deadline:
        time.sleep(0.001)  # until the engine has taken both commands and run a step
    assert seen == ([-5], [5])
    for t in senders:
        t.join()
    assert results[5]["choices"] and results[-5]["choices"]
