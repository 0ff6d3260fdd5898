"""vLLM's `cache_salt` on /v1/completions and /v1/chat/completions: validated (a non-empty
string, else a 400 naming it), passed to the engine, and isolating prefix-cache entries between
salts; accepted without effect when prefix caching is off."""

from __future__ import annotations

import pytest
from conftest import module_server

httpx = pytest.importorskip("httpx")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = list(range(3, 48))  # 45 token ids: a repeat hits (45 - 1) // 16 * 16 = 32 of them
MSGS = [{"role": "user", "content": "Tell me about state space models and their caches."}]


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _body(path, salt=None, **kw):
    body = {"prompt": PROMPT} if path == CMPL else {"messages": MSGS}
    body.update(max_tokens=4, temperature=0, **kw)
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _text(path, out):
    choice = out["choices"][0]
    return choice["text"] if path == CMPL else choice["message"]["content"]


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("salt, want", [("", "got string ''"), (5, "got number 5"),
                                        (True, "got boolean true"), (["s"], "got an array"),
                                        ({"s": 1}, "got an object")])
def test_a_bad_salt_is_a_400_naming_it(server, path, salt, want):
    err = _post(server, path, _body(path, salt), 400)["error"]
    assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error"
    assert err["message"] == f"'cache_salt' must be a non-empty string, {want}"
    assert err["code"] == ("invalid_value" if salt == "" else "invalid_type")


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_without_prefix_caching_a_salt_changes_nothing(server, path):
    plain = _text(path, _post(server, path, _body(path)))
    assert _text(path, _post(server, path, _body(path, "tenant-a"))) == plain
    assert _text(path, _post(server, path, _body(path, cache_salt=None))) == plain  # null: none


cached = module_server(enable_prefix_caching=True, max_num_seqs=4, memory_budget_bytes=32 << 20)


def _hit_tokens(server) -> int:
    return server.engine.call_sync(lambda e: e.cache_stats()["hit_tokens"])


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_salts_isolate_the_prefix_cache(cached, path):
    """Each request's reuse, read from the cache's hit counter: a repeat hits only under its
    own salt (unsalted only unsalted); the text is the same hit or miss."""
    texts, hits = [], []
    for salt in ("a", "b", None, "a", "b", None, "c"):
        before = _hit_tokens(cached)
        texts.append(_text(path, _post(cached, path, _body(path, salt))))
        hits.append(_hit_tokens(cached) - before)
    first = hits[3]
    assert first > 0 and hits == [0, 0, 0, first, first, first, 0]
    assert len(set(texts)) == 1
    # several prompts of one completions request (and n > 1) share the request's salt
    if path == CMPL:
        before = _hit_tokens(cached)
        _post(cached, path, {"prompt": [PROMPT, PROMPT], "n": 2, "max_tokens": 2,
                             "cache_salt": "a"})
        assert _hit_tokens(cached) - before == 4 * first
