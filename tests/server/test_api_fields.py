"""The request fields OpenAI and vLLM clients send (issue 23, item 4): each accepted with its
effect, or refused with a 400 naming it; /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello"}]


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "x", "suffix": "tail"}, "suffix"),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"messages": MSG, "modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"messages": MSG, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    (CHAT, {"messages": MSG, "web_search_options": {}}, "web_search_options"),
    (CHAT, {"messages": MSG, "metadata": "x"}, "metadata"),
    (CHAT, {"messages": MSG, "store": "yes"}, "store"),
    (CHAT, {"messages": MSG, "user": 5}, "user"),
    (CHAT, {"messages": MSG, "continue_final_message": True}, "continue_final_message"),
    # vLLM sampling extensions: bad values, or not implemented (refused rather than answered
    # unconstrained)
    (CMPL, {"prompt": "x", "allowed_token_ids": [5, 10**9]}, "allowed_token_ids"),
    (CHAT, {"messages": MSG, "allowed_token_ids": "5"}, "allowed_token_ids"),
    (CHAT, {"messages": MSG, "bad_words": "Hello"}, "bad_words"),
    (CMPL, {"prompt": "x", "bad_words": ["a", " "]}, "bad_words"),
    (CMPL, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    (CMPL, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (CMPL, {"prompt": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    (CHAT, {"messages": MSG, "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),
    (CHAT, {"messages": MSG, "use_beam_search": True}, "use_beam_search"),
    (CHAT, {"messages": MSG, "structural_tag": "{}"}, "structural_tag"),
])
def test_refused_fields_name_themselves(server, path, body, param):
    assert _post(server, path, body, 400)["error"]["param"] == param


def test_accepted_fields(server):
    body = {"messages": MSG, "max_tokens": 2, "user": "u-1", "metadata": {"k": "v"},
            "store": False, "service_tier": "auto", "modalities": ["text"],
            "parallel_tool_calls": False, "prompt_cache_key": "k", "safety_identifier": "s",
            "reasoning_effort": "low"}
    assert _post(server, CHAT, body)["choices"][0]["finish_reason"] == "length"
    assert _post(server, CMPL, {"prompt": "x", "max_tokens": 1, "suffix": "", "user": "u"})
    # the unimplemented vLLM extensions at their "off" values change nothing: accepted
    assert _post(server, CMPL, {"prompt": "x", "max_tokens": 1, "allowed_token_ids": [],
                                "bad_words": [], "use_beam_search": False,
                                "truncate_prompt_tokens": None})


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_allowed_token_ids(server, path):
    """vLLM's allowed_token_ids: one allowed id, so every generated token is it (its text is what
    /detokenize makes of it); with response_format it is a 400."""
    body = {"max_tokens": 3, "ignore_eos": True, "allowed_token_ids": [65]}
    body.update({"prompt": "x"} if path == CMPL else {"messages": MSG})
    out = _post(server, path, body)
    choice = out["choices"][0]
    text = choice["text"] if path == CMPL else choice["message"]["content"]
    assert text == _post(server, "/detokenize", {"tokens": [65, 65, 65]})["prompt"]
    body["response_format"] = {"type": "json_object"}
    assert "cannot be combined" in _post(server, path, body, 400)["error"]["message"]


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_bad_words(server, path):
    """vLLM's bad_words: with "a" and "b" allowed and "a" banned, every token is "b"."""
    a, b = _post(server, "/tokenize", {"prompt": "ab"})["tokens"]
    body = {"max_tokens": 3, "ignore_eos": True, "allowed_token_ids": [a, b],
            "bad_words": ["a"]}
    body.update({"prompt": "x"} if path == CMPL else {"messages": MSG})
    choice = _post(server, path, body)["choices"][0]
    assert (choice["text"] if path == CMPL else choice["message"]["content"]) == "bbb"


def test_truncate_prompt_tokens(server):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens run (a text prompt longer than
    the context too), with the same greedy output as those tokens sent alone; chat as well (-1:
    tests/engine/test_prompt.py)."""
    limit = server.engine.max_model_len
    text = "The quick brown fox. " * (limit // 10)  # byte tokens: over the context
    body = {"prompt": text, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert _post(server, CMPL, body, 400)["error"]["code"] == "context_length_exceeded"
    cut = _post(server, CMPL, {**body, "truncate_prompt_tokens": 12, "echo": True})
    ids = _post(server, "/tokenize", {"prompt": text})["tokens"][-12:]
    alone = _post(server, CMPL, {**body, "prompt": ids})
    assert cut["usage"]["prompt_tokens"] == 12
    tail = _post(server, "/detokenize", {"tokens": ids})["prompt"]
    assert cut["choices"][0]["text"] == tail + alone["choices"][0]["text"]  # echo: what ran
    chat = {"messages": MSG, "max_tokens": 1, "truncate_prompt_tokens": 5}
    assert _post(server, CHAT, chat)["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids(server, stream):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N" (the ids that
    /detokenize turns into the text), the top alternatives too; chat as well."""
    body = {"prompt": "x", "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "logprobs": 2, "return_tokens_as_token_ids": True, "stream": stream}
    if stream:
        r = httpx.post(server.url + CMPL, json=body, timeout=60)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                  for t in c["choices"][0]["logprobs"]["tokens"]]
        tops = [d for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for d in c["choices"][0]["logprobs"]["top_logprobs"]]
    else:
        choice = _post(server, CMPL, body)["choices"][0]
        text, tokens = choice["text"], choice["logprobs"]["tokens"]
        tops = choice["logprobs"]["top_logprobs"]
    assert len(tokens) == 4 and all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.split(":")[1]) for t in tokens]
    assert _post(server, "/detokenize", {"tokens": ids})["prompt"] == text
    assert all(k.startswith("token_id:") for d in tops for k in d)
    chat = _post(server, CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True,
                                "top_logprobs": 1, "return_tokens_as_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in content)


def test_max_completion_tokens_wins(server):
    """As OpenAI (max_tokens is its deprecated name) and vLLM: max_completion_tokens first."""
    body = {"messages": MSG, "max_completion_tokens": 3, "max_tokens": 7, "ignore_eos": True}
    assert _post(server, CHAT, body)["usage"]["completion_tokens"] == 3
    body = {"messages": MSG, "max_tokens": 5, "ignore_eos": True}
    assert _post(server, CHAT, body)["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_include_usage(server, path):
    client = server.client()
    kw = {"model": server.model, "max_tokens": 4, "extra_body": {"ignore_eos": True},
          "stream": True, "stream_options": {"include_usage": True}}
    stream = client.chat.completions.create(messages=MSG, **kw) if path == CHAT else \
        client.completions.create(prompt="Hello", **kw)
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4
    assert last.usage.total_tokens == last.usage.prompt_tokens + 4


def test_chat_echo_prepends_the_last_assistant_message(server):
    """vLLM's chat `echo`: the last message's content comes back first when it is the role
    being generated (the assistant's)."""
    client = server.client()
    messages = MSG + [{"role": "assistant", "content": "Well,"}]
    kw = {"model": server.model, "messages": messages, "max_tokens": 4, "temperature": 0}
    plain = client.chat.completions.create(**kw).choices[0].message.content
    echoed = client.chat.completions.create(extra_body={"echo": True}, **kw)
    assert echoed.choices[0].message.content == "Well," + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, extra_body={"echo": True}, **kw) if c.choices)
    assert streamed == "Well," + plain
    other = client.chat.completions.create(extra_body={"echo": True}, **{**kw, "messages": MSG})
    assert other.choices[0].message.content == plain  # last message is the user's: nothing


def test_continue_final_message(server):
    messages = MSG + [{"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "add_generation_prompt": False,
            "continue_final_message": True, "return_token_strs": True}
    prompt = "".join(_post(server, "/tokenize", body)["token_strs"])
    assert prompt.endswith("assistant: The answer is")  # left open, not closed by the template
    # the continuation runs (its text may be empty: two tokens of a random-weight model can be
    # an end token or half a UTF-8 character, depending on the unseeded request's sample)
    out = _post(server, CHAT, {**body, "max_tokens": 2, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 2


def test_tokenize_and_detokenize(server):
    tok = server.engine.tokenizer
    for path in ("/tokenize", "/v1/tokenize"):
        r = _post(server, path, {"prompt": "Hello, world", "return_token_strs": True})
        assert r["tokens"] == tok.encode("Hello, world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == server.engine.max_model_len
        assert "".join(r["token_strs"]) == "Hello, world"
        assert _post(server, path.replace("tokenize", "detokenize"),
                     {"tokens": r["tokens"]}) == {"prompt": "Hello, world"}
    r = _post(server, "/tokenize", {"prompt": "x"})
    assert r["token_strs"] is None
    chat = _post(server, "/tokenize", {"messages": MSG})
    text = tok.apply_chat_template(MSG, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    # the chat form gives the prompt the chat endpoint runs
    usage = _post(server, CHAT, {"messages": MSG, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == chat["count"]


def test_text_parts_are_joined_with_newlines(server):
    """Content given as text parts reaches the template as one string, the parts a line apart
    (vLLM's "string" content format): in the prompt (/tokenize, usage) and in chat `echo`."""
    tok = server.engine.tokenizer
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    joined = [{"role": "user", "content": "Hello\nworld"}]
    text = tok.apply_chat_template(joined, add_generation_prompt=True)
    assert text == "<s>user: Hello\nworld\n<s>assistant: "  # the tiny checkpoint's template
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    usage = _post(server, CHAT, {"messages": [{"role": "user", "content": parts}],
                                 "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    reply = [{"type": "text", "text": "Well,"}, {"type": "text", "text": "then"}]
    out = _post(server, CHAT, {"messages": MSG + [{"role": "assistant", "content": reply}],
                               "echo": True, "max_tokens": 2, "temperature": 0})
    assert out["choices"][0]["message"]["content"].startswith("Well,\nthen")


@pytest.mark.parametrize("part, text", [
    ({"type": "input_text", "text": "Hello"}, "Hello"),
    ({"type": "output_text", "text": "Hello"}, "Hello"),
    ({"type": "refusal", "refusal": "No."}, "No."),
    ({"type": "thinking", "thinking": "hmm", "closed": True}, "hmm"),
    ({"type": "text"}, None),  # a text or refusal part with no text is left out, as vLLM
    ({"type": "refusal", "refusal": None}, None),
])
def test_text_like_parts_are_read_as_text(server, part, text):
    """vLLM's other text-like part types reach the template as text, joined with the rest."""
    tok = server.engine.tokenizer
    content = [{"type": "text", "text": "A"}, part]
    joined = "A" if text is None else f"A\n{text}"
    expected = f"<s>user: {joined}\n<s>assistant: "  # the tiny checkpoint's template
    assert tok.apply_chat_template([{"role": "user", "content": joined}]) == expected
    out = _post(server, "/tokenize", {"messages": [{"role": "user", "content": content}]})
    assert out["tokens"] == tok.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "http://x/a.png"}},
    {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "http://x/a.mp4"}},
    {"type": "mystery", "text": "x"},
    {"type": "input_text"},
    {"type": "thinking", "thinking": 5},
])
def test_other_parts_are_refused(server, part):
    content = [{"type": "text", "text": "A"}, part]
    err = _post(server, "/tokenize", {"messages": [{"role": "user", "content": content}]},
                400)["error"]
    assert err["param"] == "messages[0].content"
    assert err["message"].startswith("messages[0].content[1]: only text parts")
    assert "\n" not in err["message"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_errors(server, path, body, param):
    assert _post(server, path, body, 400)["error"]["param"] == param
