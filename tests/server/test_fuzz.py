"""Seeded fuzzing of both endpoints: random JSON bodies, every field given values of the wrong
type, strings with lone surrogates / NULs / control characters, huge and odd numbers, broken
JSON. Every answer is < 500 with OpenAI's error body (or a 200), nothing is logged at ERROR,
and the server is healthy and idle afterwards."""

from __future__ import annotations

import json
import random

import pytest

httpx = pytest.importorskip("httpx")

from soak import ErrorLogs  # noqa: E402  (tests/server is on sys.path under pytest)

CMPL_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
               "seed", "stop", "stream", "stream_options", "logprobs", "echo", "best_of",
               "suffix", "user", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids",
               "include_stop_str_in_output", "skip_special_tokens"]
CHAT_FIELDS = [f for f in CMPL_FIELDS if f not in ("prompt", "echo", "best_of", "suffix",
                                                   "logprobs")] + [
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "functions",
    "response_format"]
WEIRD_STRINGS = ["", "\ud800", "a\udfffb", "\x00", "nul\x00in", "\u202e", "\ufffd", "é字😀",
                 "\\", '"', "{{ 7*7 }}", "{% raw %}", "<|endoftext|>", "ROMEO:", " " * 50]
WEIRD_NUMBERS = [0, -1, 1, 2, 3, 16, 17, 255, 256, 2 ** 31, 2 ** 63, 2 ** 64, -2 ** 63 - 1,
                 10 ** 30, 1e308, -1e308, 1e-320, 0.5, -0.0, 1.0, 3.0, 1e300]


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.25:
        return rng.choice(WEIRD_NUMBERS)
    if r < 0.45:
        return rng.choice(WEIRD_STRINGS)
    if r < 0.55:
        return rng.choice([True, False, None])
    if r < 0.75 and depth < 3:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.9 and depth < 3:
        keys = rng.sample(["role", "content", "type", "text", "name", "include_usage",
                           "continuous_usage_stats", "x"], rng.randint(0, 4))
        return {k: _value(rng, depth + 1) for k in keys}
    return rng.choice([[1, 2, 3], [[5, 6]], ["ab", "cd"], {"type": "text"},
                       [{"role": "user", "content": "hi"}], [{"role": "tool"}]])


def _valid(chat: bool) -> dict:
    if chat:
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"prompt": "hi", "max_tokens": 2}


def _bodies(seed: int, n: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        chat = i % 2 == 1
        path = "/v1/chat/completions" if chat else "/v1/completions"
        fields = CHAT_FIELDS if chat else CMPL_FIELDS
        kind = rng.random()
        if kind < 0.6:  # a valid request with 1-3 fields replaced by random values
            body = _valid(chat)
            for f in rng.sample(fields, rng.randint(1, 3)):
                body[f] = _value(rng)
            for f in ("max_tokens", "max_completion_tokens", "min_tokens"):
                if isinstance(body.get(f), int) and body[f] > 4:
                    body[f] = 4  # keep the valid ones short
            raw = json.dumps(body).encode()
        elif kind < 0.85:  # random objects
            raw = json.dumps({f: _value(rng) for f in rng.sample(fields, rng.randint(0, 6))}
                             ).encode()
        else:  # broken or odd JSON text
            raw = rng.choice([b"", b"{", b"null", b"[]", b'"str"', b"1e999999", b"{\"a\":}",
                              b'{"prompt": NaN}', b'{"prompt": "x"' + b"}" * 3,
                              b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"[" * 5000 + b"]" * 5000,
                              b'{"max_tokens": ' + b"9" * 5000 + b', "prompt": "x"}'])
        out.append((path, raw))
    return out


def test_fuzzed_requests_never_get_a_5xx(server):
    bodies = _bodies(seed=1234, n=400)
    statuses: dict[int, int] = {}
    with ErrorLogs() as errors, httpx.Client(base_url=server.url, timeout=60) as c:
        for path, raw in bodies:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (raw[:200], r.text[:300])
            if r.status_code == 200:
                continue
            assert r.headers["content-type"].startswith("application/json"), r.text[:200]
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert isinstance(err["message"], str) and err["message"], err
            assert "\n" not in err["message"] and "Traceback" not in err["message"]
    assert errors.records == []
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 10, statuses  # both kinds hit
    assert httpx.get(server.url + "/health").status_code == 200
    p = server.wait_idle()
    assert p["running"] == 0 and p["free_slots"] == p["slots"], p
    server.engine.call_sync(lambda e: e.check_integrity())
