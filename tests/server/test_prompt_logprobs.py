"""vLLM's `prompt_logprobs` request field on /v1/completions (per choice) and
/v1/chat/completions (top level): per prompt token, null for the first, then
{"<id>": {"logprob", "rank", "decoded_token"}} with the prompt token first and its top-k
alternatives ranked 1..k. Checked against a reference forward (transformers) and the engine;
refused with stream (unless 0) and out of bounds, as vLLM."""

from __future__ import annotations

import pytest
import torch

from mambaserve import SamplingParams

httpx = pytest.importorskip("httpx")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello there"}]
IDS = torch.randint(3, 320, (14,), generator=torch.Generator().manual_seed(8)).tolist()


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json={"model": server.model, **body}, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _reference(hf_model, ids) -> torch.Tensor:
    """Full-vocabulary logprobs of each next token: row i predicts ids[i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)


def _check(plp: list, ids: list[int], k: int, ref: torch.Tensor, engine, tt) -> None:
    """`plp` is vLLM's prompt_logprobs of `ids` against the reference rows and the engine's
    own prompt logprobs (`engine`, a RequestOutput)."""
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry, tid, row = plp[i], ids[i], ref[i - 1]
        assert next(iter(entry)) == str(tid)  # the prompt token first
        own = entry[str(tid)]
        assert own["logprob"] == pytest.approx(engine.prompt_logprobs[i][tid], abs=1e-6)
        assert own["logprob"] == pytest.approx(row[tid].item(), abs=1e-4)
        assert own["decoded_token"] == tt(tid)
        # brute force over the vocabulary, up to rounding between the two forwards
        lo = int((row > row[tid] + 1e-4).sum()) + 1
        hi = int((row >= row[tid] - 1e-4).sum())
        assert lo <= own["rank"] <= hi, (i, own, lo, hi)
        # the alternatives: the k likeliest tokens, ranked 1..k in order (the prompt token
        # among them when it is one of them, at its place)
        alts = {int(t): e for t, e in entry.items() if e["rank"] <= k}
        if own["rank"] > k:
            assert len(entry) == k + 1
        assert sorted(e["rank"] for e in alts.values()) == list(range(1, k + 1))
        assert set(alts) == set(torch.topk(row, k).indices.tolist())
        for t, e in alts.items():
            assert e["logprob"] == pytest.approx(row[t].item(), abs=1e-4)
            assert e["decoded_token"] == tt(t)
        by_rank = [alts[t]["logprob"] for t in sorted(alts, key=lambda t: alts[t]["rank"])]
        assert by_rank == sorted(by_rank, reverse=True)


def test_completions_prompt_logprobs(server, offline, hf_model):
    out = _post(server, CMPL, {"prompt": IDS, "prompt_logprobs": 3, "max_tokens": 2, "n": 2,
                               "temperature": 0})
    engine = offline.generate({"prompt_token_ids": IDS},
                              SamplingParams(prompt_logprobs=3, max_tokens=1))[0]
    plp = out["choices"][0]["prompt_logprobs"]
    _check(plp, IDS, 3, _reference(hf_model, IDS), engine, server.engine.tokenizer.token_text)
    assert out["choices"][1]["prompt_logprobs"] == plp  # every choice of the prompt
    assert out["choices"][0]["logprobs"] is None  # the OpenAI logprobs stay off
    assert any(e["rank"] > 20 for e in (d[str(t)] for d, t in zip(plp[1:], IDS[1:])))
    # k = 0: the prompt token alone, with its rank
    zero = _post(server, CMPL, {"prompt": IDS, "prompt_logprobs": 0, "max_tokens": 1})
    got = zero["choices"][0]["prompt_logprobs"]
    assert [list(d) for d in got[1:]] == [[str(t)] for t in IDS[1:]]
    assert [d[str(t)]["rank"] for d, t in zip(got[1:], IDS[1:])] == \
        [d[str(t)]["rank"] for d, t in zip(plp[1:], IDS[1:])]


def test_chat_prompt_logprobs_at_the_top_level(server, offline, hf_model):
    out = _post(server, CHAT, {"messages": MSG, "prompt_logprobs": 2, "max_tokens": 1})
    ids = _post(server, "/tokenize", {"messages": MSG})["tokens"]
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert all("prompt_logprobs" not in c for c in out["choices"])
    engine = offline.generate({"prompt_token_ids": ids},
                              SamplingParams(prompt_logprobs=2, max_tokens=1))[0]
    _check(out["prompt_logprobs"], ids, 2, _reference(hf_model, ids), engine,
           server.engine.tokenizer.token_text)


def test_absent_unless_asked_and_echo_interplay(server):
    plain = _post(server, CMPL, {"prompt": IDS, "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]
    assert "prompt_logprobs" not in _post(server, CHAT, {"messages": MSG, "max_tokens": 1})
    # echo with logprobs: vLLM returns the echoed prompt's logprobs as prompt_logprobs too;
    # prompt_logprobs sets their width, logprobs the echoed top_logprobs'
    echo = _post(server, CMPL, {"prompt": IDS, "max_tokens": 1, "echo": True, "logprobs": 1})
    assert all(len(d) in (1, 2) for d in echo["choices"][0]["prompt_logprobs"][1:])
    both = _post(server, CMPL, {"prompt": IDS, "max_tokens": 1, "echo": True, "logprobs": 1,
                                "prompt_logprobs": 3})
    choice = both["choices"][0]
    assert all(len(d) == 1 for d in choice["logprobs"]["top_logprobs"][1:len(IDS)])
    assert all(len(d) in (3, 4) for d in choice["prompt_logprobs"][1:])
    assert choice["logprobs"]["token_logprobs"][1:len(IDS)] == \
        [d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"][1:], IDS[1:])]


def test_token_ids_as_text_leaves_decoded_tokens_alone(server):
    """As vLLM: return_tokens_as_token_ids renames the OpenAI logprobs' tokens only."""
    body = {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 1, "logprobs": 0}
    a = _post(server, CMPL, body)["choices"][0]
    b = _post(server, CMPL, {**body, "return_tokens_as_token_ids": True})["choices"][0]
    assert a["prompt_logprobs"] == b["prompt_logprobs"]
    assert b["logprobs"]["tokens"][0].startswith("token_id:")


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("value,stream,words", [
    (-1, False, "whole vocabulary"), (21, False, "<= 20"), (-2, False, ">= 0"),
    ("2", False, "an integer"), (1.5, False, "an integer"), (True, False, "an integer"),
    (1, True, "stream"),
])
def test_bad_values_are_one_line_400s(server, path, value, stream, words):
    body = {"prompt": IDS} if path == CMPL else {"messages": MSG}
    err = _post(server, path, {**body, "prompt_logprobs": value, "stream": stream,
                               "max_tokens": 1}, 400)["error"]
    assert err["param"] == "prompt_logprobs" and words in err["message"]
    assert "\n" not in err["message"]


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_stream_takes_zero_and_sends_none(server, path):
    """vLLM refuses prompt_logprobs > 0 with stream (above); 0 is accepted and no chunk
    carries prompt logprobs."""
    body = {"prompt": IDS} if path == CMPL else {"messages": MSG}
    with httpx.stream("POST", server.url + path, timeout=60, json={
            "model": server.model, **body, "prompt_logprobs": 0, "stream": True,
            "max_tokens": 2}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    # at least one chunk before [DONE] (two tokens may arrive in one chunk: a token that
    # decodes to no text yet is sent with the next)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2
    assert not any("prompt_logprobs" in ln for ln in lines)
