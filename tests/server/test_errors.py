"""Bad input gets OpenAI-shaped 4xx errors (never a 500), overload a 429, and the server stays
healthy; /metrics is valid Prometheus text."""

from __future__ import annotations

import concurrent.futures
import re

import pytest

httpx = pytest.importorskip("httpx")

openai = pytest.importorskip("openai")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
LONG = "x" * 5000  # byte-level tokenizer: 5000 tokens > the 4096-token context

# (endpoint, raw body or JSON object, status, param the error names)
CASES = [
    (CMPL, b"{not json", 400, None),
    (CMPL, b"", 400, None),
    (CMPL, b"[1, 2]", 400, None),
    (CMPL, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (CMPL, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    (CMPL, {"max_tokens": 4}, 400, "prompt"),
    (CMPL, {"prompt": 123}, 400, "prompt"),
    (CMPL, {"prompt": ["a", 1]}, 400, "prompt"),
    (CMPL, {"prompt": [[1, 2], "a"]}, 400, "prompt"),
    (CMPL, {"prompt": [1, True]}, 400, "prompt"),
    (CMPL, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    (CMPL, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (CMPL, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (CMPL, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (CMPL, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (CMPL, {"prompt": "x", "n": 17}, 400, "n"),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n"),
    (CMPL, {"prompt": "x", "n": True}, 400, "n"),
    (CMPL, {"prompt": "x", "seed": "s"}, 400, "seed"),
    (CMPL, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (CMPL, {"prompt": "x", "stop": [1]}, 400, "stop"),
    (CMPL, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (CMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (CMPL, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    (CMPL, {"prompt": "x", "presence_penalty": 3.0}, 400, "presence_penalty"),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias"),
    (CMPL, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    (CMPL, {"prompt": "x", "stream_options": "on", "stream": True}, 400, "stream_options"),
    (CMPL, {"prompt": ""}, 400, "prompt"),
    (CMPL, {"prompt": []}, 400, "prompt"),
    (CMPL, {"prompt": ["ok", ""]}, 400, "prompt"),
    (CMPL, {"prompt": [[]]}, 400, "prompt"),
    (CMPL, {"prompt": [5, 320]}, 400, "prompt"),
    (CMPL, {"prompt": [-1]}, 400, "prompt"),
    (CMPL, {"prompt": LONG}, 400, "prompt"),
    (CMPL, {"prompt": [7] * 4096}, 400, "prompt"),
    (CMPL, {"prompt": ["a"] * 300}, 400, "prompt"),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    (CMPL, {"prompt": "x", "model": 5}, 400, "model"),
    (CHAT, {"model": "nope", "messages": MSG}, 404, "model"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": MSG, "logprobs": 3}, 400, "logprobs"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": MSG, "n": 100}, 400, "n"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400,
     "response_format"),
]


def _check_error(r: httpx.Response, status: int, param) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    return err


@pytest.mark.parametrize("path,body,status,param", CASES,
                         ids=[f"{i}-{c[0].split('/')[-1]}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_input(server, path, body, status, param):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
    err = _check_error(r, status, param)
    assert err["type"] == "invalid_request_error"
    if param in ("prompt", "messages") and "context" in err["message"]:
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body, engine_prompt, code", [
    (CMPL, {"prompt": [[]]}, [], "empty_prompt"),
    (CMPL, {"prompt": ""}, "", "empty_prompt"),
    (CMPL, {"prompt": [5, 320]}, [5, 320], "invalid_value"),
    (CMPL, {"prompt": [[5], [7] * 4096]}, [7] * 4096, "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": LONG}]}, None, "context_length_exceeded"),
])
def test_prompt_errors_are_the_engines(server, offline, path, body, engine_prompt, code):
    """The server refuses a prompt with the Python API's own message, and an OpenAI code."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    err = _check_error(r, 400, "prompt" if path == CMPL else "messages")
    assert err["code"] == code
    if engine_prompt is None:  # the chat template's text, as LLM.chat would build it
        engine_prompt = server.engine.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True)
    if not isinstance(engine_prompt, str):
        engine_prompt = {"prompt_token_ids": engine_prompt}
    with pytest.raises(ValueError) as e:
        offline.generate(engine_prompt)
    assert str(e.value) == err["message"]


def test_openai_client_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSG)
    assert e.value.body["code"] == "model_not_found"


def test_unknown_routes_and_methods(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + CMPL)
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(server.url + "/v1/models/gpt-4")
    _check_error(r, 404, "model")


def test_chat_without_template_is_a_clear_400(server, monkeypatch):
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", None)
    r = httpx.post(server.url + CHAT, json={"messages": MSG})
    err = _check_error(r, 400, "messages")
    assert err["code"] == "no_chat_template" and "chat template" in err["message"]
    # completions still work
    assert httpx.post(server.url + CMPL, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_full_queue_answers_429(server):
    server.engine.max_waiting = 0  # only requests the scheduler can start at once get in
    body = {"prompt": "hold the line", "max_tokens": 24, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                concurrent.futures.ThreadPoolExecutor(40) as pool:
            rs = list(pool.map(lambda _: c.post(CMPL, json=body), range(40)))
    finally:
        server.engine.max_waiting = None
    codes = sorted(r.status_code for r in rs)
    assert set(codes) == {200, 429}, codes
    assert codes.count(200) >= 16  # 16 seats on the test server
    for r in rs:
        if r.status_code == 429:
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert _metric(server, "mambaserve_requests_rejected_total") >= codes.count(429)


def _metrics_text(server) -> str:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def _metric(server, name: str, labels: str = "") -> float:
    for line in _metrics_text(server).splitlines():
        if line.startswith(name + "{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})?'
                    r' (-?[0-9.e+-]+|NaN|[+-]Inf)$')


def test_metrics_are_prometheus_text_and_idle(server):
    httpx.post(server.url + CMPL, json={"prompt": "metrics", "max_tokens": 3}, timeout=30)
    server.wait_idle()
    import time
    time.sleep(0.1)  # the engine publishes its gauges when it goes idle
    text = _metrics_text(server)
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            names.add(line.split()[2])
        elif not line.startswith("#"):
            assert SAMPLE.match(line), line
    for want in ("requests_finished_total", "prompt_tokens_total", "generation_tokens_total",
                 "num_requests_running", "num_requests_waiting", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "state_slots_used", "state_slot_usage_ratio", "kv_pages_used",
                 "kv_page_usage_ratio", "prefix_cache_token_hit_rate",
                 "prefix_cache_request_hit_rate", "http_requests_total", "engine_step_seconds"):
        assert f"mambaserve_{want}" in names, want
    assert _metric(server, "mambaserve_num_requests_running") == 0
    assert _metric(server, "mambaserve_state_slots_used") == 0
    assert _metric(server, "mambaserve_kv_pages_used") == 0
    assert _metric(server, "mambaserve_time_to_first_token_seconds_count") >= 1
    assert _metric(server, "mambaserve_engine_step_seconds_count", 'kind="prefill"') >= 1
    assert _metric(server, "mambaserve_engine_step_seconds_count", 'kind="decode"') >= 1
    assert _metric(server, "mambaserve_generation_tokens_total") >= 3
    assert _metric(server, "mambaserve_requests_finished_total", 'finish_reason="length"') >= 1
    # no 500 was ever answered in this session
    assert 'status="500"' not in text
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_engine_failure_is_a_503_and_the_server_keeps_serving(server):
    engine = server.engine.engine
    real_step = engine.step
    state = {"fail": True}

    def failing_step():
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = failing_step
    try:
        r = httpx.post(server.url + CMPL, json={"prompt": "x", "max_tokens": 4}, timeout=30)
        err = _check_error(r, 503, None)
        assert err["type"] == "server_error" and err["code"] == "engine_error"
        assert "injected failure" in err["message"]
        # a stream that is already running gets the error in-band, then [DONE]
        state["fail"] = True
        with httpx.stream("POST", server.url + CMPL, timeout=30,
                          json={"prompt": "x", "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            lines = [ln for ln in s.iter_lines() if ln]
        assert '"engine_error"' in lines[-2] and lines[-1] == "data: [DONE]"
    finally:
        engine.step = real_step
    server.wait_idle()
    r = httpx.post(server.url + CMPL, json={"prompt": "x", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health").status_code == 200
