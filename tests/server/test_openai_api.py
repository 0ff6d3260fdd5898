"""The OpenAI-compatible endpoints, driven by the official `openai` client against a real
server over the tiny checkpoint."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")

from mambaserve import SamplingParams

openai = pytest.importorskip("openai")


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def stream_text(chunks, chat=False):
    """Concatenated text per choice index, finish reasons, and the usage chunk (if any)."""
    texts, reasons, usage = {}, {}, None
    for ch in chunks:
        if ch.usage is not None and not ch.choices:
            usage = ch.usage
        for c in ch.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in reasons, "a choice finished twice"
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def test_health_models_version(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    assert httpx.get(f"{server.url}/v1/models/{server.model}").status_code == 200
    assert httpx.get(server.url + "/version").status_code == 200


def test_completion_matches_offline(server, offline):
    ref = offline.generate("ROMEO:", greedy())[0]
    r = server.client().completions.create(model=server.model, prompt="ROMEO:", max_tokens=8,
                                           temperature=0)
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_stream(server):
    client = server.client()
    kw = {"model": server.model, "prompt": "To be, or not to be", "max_tokens": 12,
          "temperature": 0}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    texts, reasons, usage = stream_text(chunks)
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: full.choices[0].finish_reason}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage there is no usage chunk
    plain = list(client.completions.create(**kw, stream=True))
    assert all(not getattr(c, "usage", None) for c in plain)


def test_chat_matches_offline_stream_and_non_stream(server, offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Who are you?"}]
    ref = offline.chat(messages, greedy(10))[0].outputs[0]
    client = server.client()
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    texts, reasons, usage = stream_text(chunks, chat=True)
    assert texts == {0: ref.text} and reasons == {0: ref.finish_reason}
    assert usage.completion_tokens == len(ref.token_ids) == r.usage.completion_tokens


def test_n_seed_and_sampling_params(server):
    client = server.client()
    kw = {"model": server.model, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0,
          "top_p": 0.9, "n": 3, "seed": 7, "extra_body": {"top_k": 50, "min_p": 0.01}}
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded
    assert a.usage.completion_tokens == 18
    chunks = list(client.completions.create(**kw, stream=True))
    texts, reasons, _ = stream_text(chunks)
    assert texts == {c.index: c.text for c in a.choices}
    assert set(reasons) == {0, 1, 2}
    # chat with n
    r = client.chat.completions.create(model=server.model, n=2, max_tokens=4, seed=1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in r.choices] == [0, 1]


def _stop_char(text: str) -> tuple[str, int]:
    for i, ch in enumerate(text):
        if i >= 2 and ch.isascii() and ch.isprintable() and ch not in text[:i]:
            return ch, i
    pytest.skip("no usable stop character in the greedy output")


def test_stop_strings(server, offline):
    prompt = "The quick brown fox"
    full = offline.generate(prompt, greedy(16, ignore_eos=True))[0].outputs[0].text
    ch, at = _stop_char(full)
    client = server.client()
    for stop in (ch, [ch, "\u2603never"]):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=16,
                                      temperature=0, stop=stop, extra_body={"ignore_eos": True})
        assert r.choices[0].text == full[:at]
        assert r.choices[0].finish_reason == "stop"
        texts, reasons, _ = stream_text(client.completions.create(
            model=server.model, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
            stream=True, extra_body={"ignore_eos": True}))
        assert texts == {0: full[:at]} and reasons == {0: "stop"}


def test_completion_logprobs(server, offline):
    ref = offline.generate("abc", greedy(5, logprobs=3))[0].outputs[0]
    r = server.client().completions.create(model=server.model, prompt="abc", max_tokens=5,
                                           temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for i, tid in enumerate(ref.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprobs[i][tid], abs=1e-5)
        assert 1 <= len(lp.top_logprobs[i]) <= 2
        # greedy: the chosen token is the most likely one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    # streamed logprobs cover the same tokens
    toks = []
    for ch in server.client().completions.create(model=server.model, prompt="abc", max_tokens=5,
                                                 temperature=0, logprobs=0, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            toks += ch.choices[0].logprobs.token_logprobs
    assert toks == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(server):
    client = server.client()
    msgs = [{"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert isinstance(e.bytes, list)
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=3,
                                       temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_prompt_forms_batch_and_echo(server, offline):
    client = server.client()
    tok = offline.get_tokenizer()
    prompts = ["alpha", "beta gamma", "delta"]
    refs = [o.outputs[0].text for o in offline.generate(prompts, greedy(6))]
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == refs
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    # token ids, and a batch of token-id lists
    ids = tok.encode("beta gamma")
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == refs[1]
    r = client.completions.create(model=server.model, prompt=[ids, tok.encode("delta")],
                                  max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[1], refs[1], refs[2], refs[2]]
    # a batch streamed: every choice gets its text and one finish
    texts, reasons, _ = stream_text(client.completions.create(
        model=server.model, prompt=prompts, max_tokens=6, temperature=0, stream=True))
    assert texts == dict(enumerate(refs)) and set(reasons) == {0, 1, 2}
    # echo
    r = client.completions.create(model=server.model, prompt="alpha", max_tokens=6,
                                  temperature=0, echo=True)
    assert r.choices[0].text == "alpha" + refs[0]
    texts, _, _ = stream_text(client.completions.create(
        model=server.model, prompt="alpha", max_tokens=6, temperature=0, echo=True, stream=True))
    assert texts == {0: "alpha" + refs[0]}


def test_model_field_may_be_the_path_or_absent(server, tiny_ckpt):
    body = {"prompt": "x", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    body["model"] = str(tiny_ckpt)
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_continuous_usage_stats(server):
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    counts = []
    import json
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                obj = json.loads(line[6:])
                counts.append(obj["usage"]["completion_tokens"])
                assert obj["usage"]["prompt_tokens"] == 3
    assert counts == sorted(counts) and counts[-1] == 5 and counts[-2] == 5
