"""Scoring through `echo` as lm-evaluation-harness does it. Its `local-completions` model
(lm_eval/models/openai_completions.py, LocalCompletionsAPI) posts, for loglikelihood requests,
exactly {"model", "prompt": [context + continuation token ids, ...], "temperature": 0,
"max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true} and reads each choice (sorted by
index) as `sum(token_logprobs[ctxlen:-1])` with `is_greedy` from `top_logprobs[ctxlen:-1]`
(`parse_logprobs`, re-implemented below). The result must be the engine's own prompt logprobs
of the continuation."""

from __future__ import annotations

import math
from operator import itemgetter

import pytest

from mambaserve import SamplingParams

httpx = pytest.importorskip("httpx")

CONTEXTS = ["The quick brown fox", "Once upon a time, in a land", "a"]
CONTINUATIONS = [" jumps over", " far away", " b c d e f"]


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs, as written there."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        assert ctxlen > 0
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


@pytest.fixture(scope="module")
def requests(server):
    tok = server.engine.tokenizer
    ctx = [tok.encode(c) for c in CONTEXTS]
    cont = [tok.encode(c, add_special_tokens=False) for c in CONTINUATIONS]
    return ctx, cont


def _reference(offline, ctx, cont) -> list[tuple[float, bool]]:
    """The engine's prompt logprobs of each continuation, and whether each token was argmax."""
    prompts = [{"prompt_token_ids": a + b} for a, b in zip(ctx, cont)]
    outs = offline.generate(prompts, SamplingParams(prompt_logprobs=1, max_tokens=1,
                                                    temperature=0))
    ref = []
    for o, a in zip(outs, ctx):
        ids, lps = o.prompt_token_ids, o.prompt_logprobs
        total = sum(lps[i][ids[i]] for i in range(len(a), len(ids)))
        greedy = all(lps[i][ids[i]] == max(lps[i].values()) for i in range(len(a), len(ids)))
        ref.append((total, greedy))
    return ref


def _payload(server, ids, **kw) -> dict:
    return {"model": server.model, "prompt": ids, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True, **kw}


def test_lm_eval_loglikelihood(server, offline, requests):
    ctx, cont = requests
    r = httpx.post(server.url + "/v1/completions",
                   json=_payload(server, [a + b for a, b in zip(ctx, cont)]), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    got = lm_eval_parse_logprobs(body, [len(a) for a in ctx])
    ref = _reference(offline, ctx, cont)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, ref):
        assert lp == pytest.approx(ref_lp, abs=1e-5) and greedy == ref_greedy
    assert any(lp != 0 for lp, _ in got)  # the bug this fixes: every loglikelihood was 0
    tt = server.engine.tokenizer.token_text
    for choice, a, b in zip(sorted(body["choices"], key=itemgetter("index")), ctx, cont):
        lp = choice["logprobs"]
        n = len(a) + len(b)
        assert len(lp["tokens"]) == n + 1  # every prompt token, then the generated one
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][:n] == [tt(t) for t in a + b]
        assert all(isinstance(x, float) and math.isfinite(x) for x in lp["token_logprobs"][1:])
        offsets = [0]
        for t in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(t))
        assert lp["text_offset"] == offsets
        assert choice["text"].startswith(CONTEXTS[ctx.index(a)])


def test_max_tokens_zero_scores_only(server, offline, requests):
    ctx, cont = requests
    ids = [a + b for a, b in zip(ctx, cont)]
    r = httpx.post(server.url + "/v1/completions", json=_payload(server, ids, max_tokens=0),
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 0
    ref = _reference(offline, ctx, cont)
    for choice, a, b, (ref_lp, _) in zip(sorted(body["choices"], key=itemgetter("index")),
                                         ctx, cont, ref):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(a) + len(b)  # the prompt's tokens only
        assert sum(lp["token_logprobs"][len(a):]) == pytest.approx(ref_lp, abs=1e-5)
        assert choice["finish_reason"] == "length"
        assert choice["text"] == server.engine.tokenizer.decode(a + b, skip_special_tokens=False)


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_logprobs_equal_the_plain_ones(server, requests, max_tokens):
    ctx, cont = requests
    client = server.client()
    prompt = ctx[1] + cont[1]
    kw = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "logprobs": 2,
          "echo": True, "temperature": 0}
    plain = client.completions.create(**kw).choices[0]
    text, tokens, lps, offsets, finish = "", [], [], [], None
    for chunk in client.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
                offsets += ch.logprobs.text_offset
            finish = ch.finish_reason or finish
    assert text == plain.text and finish == plain.finish_reason
    assert tokens == plain.logprobs.tokens and lps == plain.logprobs.token_logprobs
    assert offsets == plain.logprobs.text_offset
    assert len(tokens) == len(prompt) + max_tokens


def test_max_tokens_zero_needs_echo(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "x", "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
