"""vLLM's --enable-prompt-tokens-details: with it, every usage object (completions and chat,
whole and streamed, per-chunk usage too) carries prompt_tokens_details.cached_tokens, the
prompt tokens the prefix cache served (0 on a miss), each prompt counted once whatever n;
without it (the default) the field is absent."""

from __future__ import annotations

import json

import pytest
from conftest import module_server

httpx = pytest.importorskip("httpx")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _prompt(start: int) -> list[int]:
    """45 token ids of their own per test (a module-wide cache: tests must not share prompts)."""
    return list(range(start, start + 45))


def _msgs(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Tell me about {topic}, and then some more about it."}]


def _post(server, path, body):
    r = httpx.post(server.url + path, json={"max_tokens": 3, "temperature": 0, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(server, path, body) -> list[dict]:
    body = {"max_tokens": 3, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


details = module_server(enable_prefix_caching=True, enable_prompt_tokens_details=True,
                        max_num_seqs=4, memory_budget_bytes=32 << 20)


def _interval(server) -> int:
    return server.engine.call_sync(lambda e: e.prefix_cache.interval)


def _hits(server) -> int:
    """The engine's own count of prompt tokens served from the cache, over all sequences."""
    return server.engine.call_sync(lambda e: e.cache_stats()["hit_tokens"])


def _cached(usage: dict) -> int:
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}, usage
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_off_by_default(server, path):
    """The shared server is built with the defaults: no prompt_tokens_details anywhere."""
    body = {"prompt": _prompt(3)} if path == CMPL else {"messages": _msgs("defaults")}
    assert "prompt_tokens_details" not in _post(server, path, body)["usage"]
    chunks = _stream(server, path, {**body, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert all("prompt_tokens_details" not in c["usage"] for c in chunks)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_a_miss_reports_0_and_a_repeat_the_engines_hit(details, path):
    body = {"prompt": _prompt(10)} if path == CMPL else {"messages": _msgs(f"misses {path}")}
    before = _hits(details)
    first = _post(details, path, body)["usage"]
    assert _cached(first) == 0 and _hits(details) == before
    again = _post(details, path, body)["usage"]
    hit = _hits(details) - before  # what the engine reused for the repeat (num_cached_tokens)
    interval = _interval(details)
    assert _cached(again) == hit == (first["prompt_tokens"] - 1) // interval * interval > 0
    assert again["prompt_tokens"] == first["prompt_tokens"]  # cached tokens still count


def test_several_prompts_and_n_count_each_prompt_once(details):
    p, q = _prompt(60), _prompt(120)
    _post(details, CMPL, {"prompt": p})  # p is cached, q is not
    before = _hits(details)
    usage = _post(details, CMPL, {"prompt": [p, q, p], "n": 2})["usage"]
    hit = (45 - 1) // _interval(details) * _interval(details)
    assert _hits(details) - before == 2 * 2 * hit  # the engine: every sequence of p hit
    assert usage["prompt_tokens"] == 3 * 45 and _cached(usage) == 2 * hit


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_streamed_usage(details, path):
    """The final usage chunk, and the per-chunk usage of continuous_usage_stats (whose count is
    known once the engine admitted the prompt: 0 on a chunk sent before that)."""
    body = {"prompt": _prompt(180)} if path == CMPL else {"messages": _msgs(f"streams {path}")}
    whole = _post(details, path, body)["usage"]
    hit = (whole["prompt_tokens"] - 1) // _interval(details) * _interval(details)
    chunks = _stream(details, path, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and _cached(chunks[-1]["usage"]) == hit
    assert all(c["usage"] is None for c in chunks[:-1])
    chunks = _stream(details, path, {**body, "n": 2, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    counts = [_cached(c["usage"]) for c in chunks]
    assert counts == sorted(counts) and counts[-2] == counts[-1] == hit > 0
