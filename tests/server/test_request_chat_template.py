"""Two of vLLM's chat request extras: `chat_template` (a template of the request's own, taken
only by a server started with --trust-request-chat-template, refused with a 400 otherwise, on
/v1/chat/completions and /tokenize alike), and chat `echo` (the last message is prepended to the
generated one when both have the same role: the assistant's after a generation prompt, else
the last message's own), whole and streamed."""

from __future__ import annotations

import json

import pytest
from conftest import module_server

httpx = pytest.importorskip("httpx")

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello"}]
# every ASCII character is one token of the tiny checkpoint's byte-level tokenizer (no merges)
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}>{{ greeting }}{% endif %}")


def _post(server, path, body, status=200):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _stream(server, body) -> list[dict]:
    with httpx.stream("POST", server.url + CHAT, json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _prompt(server, body) -> str:
    r = _post(server, "/tokenize", {"return_token_strs": True, **body})
    return "".join(r["token_strs"])


trusting = module_server(trust_request_chat_template=True, max_num_seqs=4,
                         memory_budget_bytes=32 << 20)


# ---- chat_template ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", [CHAT, "/tokenize"])
@pytest.mark.parametrize("extra,param", [
    ({"chat_template": BRACKETS}, "chat_template"),
    ({"chat_template": ""}, "chat_template"),  # present: refused, as vLLM (`is not None`)
    ({"chat_template_kwargs": {"chat_template": BRACKETS}}, "chat_template_kwargs"),
])
def test_request_template_refused_without_the_flag(server, path, extra, param):
    err = _post(server, path, {"messages": MSG, "max_tokens": 2, **extra}, 400)["error"]
    assert err["param"] == param and err["code"] == "untrusted_chat_template"
    assert "--trust-request-chat-template" in err["message"] and "\n" not in err["message"]
    # a null template is no template
    _post(server, path, {"messages": MSG, "max_tokens": 2, "chat_template": None})


def test_request_template_renders_the_prompt(trusting):
    tok = trusting.engine.tokenizer
    body = {"messages": MSG, "chat_template": BRACKETS, "chat_template_kwargs": {"greeting": "hi"}}
    assert _prompt(trusting, body) == "[user|Hello]>hi"
    out = _post(trusting, CHAT, {**body, "max_tokens": 2, "ignore_eos": True})
    assert out["usage"]["prompt_tokens"] == len("[user|Hello]>hi")
    # the template options reach it as they reach the model's
    assert _prompt(trusting, {**body, "add_generation_prompt": False}) == "[user|Hello]"
    # without one (or with an empty one, as vLLM's `or`) the model's template is back
    default = tok.apply_chat_template(MSG, add_generation_prompt=True)
    for other in ({}, {"chat_template": ""}, {"chat_template": None}):
        assert _prompt(trusting, {"messages": MSG, **other}) == default
        out = _post(trusting, CHAT, {"messages": MSG, "max_tokens": 2, **other})
        assert out["usage"]["prompt_tokens"] == len(tok.encode(default, add_special_tokens=False))
    # vLLM refuses a template inside chat_template_kwargs even when trusting request templates
    err = _post(trusting, CHAT, {"messages": MSG, "chat_template_kwargs": {
        "chat_template": BRACKETS}}, 400)["error"]
    assert err["param"] == "chat_template_kwargs" and "'chat_template'" in err["message"]


@pytest.mark.parametrize("template,says", [
    ("{% for m in messages %}{{ m['content'] }}", "does not compile"),  # no endfor
    ("{{ raise_exception('no\nsuch\n  role') }}", "no such role"),  # refused, on one line
    ("{{ messages[7]['content']['x'] }}", "UndefinedError"),  # fails while rendering
    ("{{ messages.__class__.__mro__ }}", "sandbox"),  # stopped by the sandbox
    ("{{ " + "(" * 5000 + " }}", "does not compile"),  # a parser RecursionError
    (5, "must be a string"),
])
def test_broken_request_template_is_a_400(trusting, template, says):
    for path in (CHAT, "/tokenize"):
        for stream in (False, True):
            if stream and path != CHAT:
                continue
            body = {"messages": MSG, "max_tokens": 2, "chat_template": template, "stream": stream}
            err = _post(trusting, path, body, 400)["error"]
            assert err["param"] == "chat_template", err
            assert says in err["message"] and "\n" not in err["message"], err
    assert _post(trusting, CHAT, {"messages": MSG, "max_tokens": 1})["choices"]  # still serves


# ---- echo ------------------------------------------------------------------------------------
def _texts(server, body) -> tuple[dict, str, list[dict]]:
    """(the whole message, the streamed content, the streamed chunks) of `body`."""
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True, **body}
    message = _post(server, CHAT, body)["choices"][0]["message"]
    chunks = _stream(server, body)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                      if c["choices"])
    return message, content, chunks


@pytest.mark.parametrize("messages,add_gen,role,echoed", [
    # the last message has the role of the message generated: it is prepended
    (MSG + [{"role": "assistant", "content": "Well,"}], False, "assistant", "Well,"),
    (MSG, False, "user", "Hello"),  # no generation prompt: the user's message goes on
    # another role than the one generated: nothing is echoed
    (MSG, True, "assistant", ""),
    (MSG + [{"role": "assistant", "content": "Well,"}, {"role": "user", "content": "Go"}],
     True, "assistant", ""),
])
def test_chat_echo_whole_and_streamed(server, messages, add_gen, role, echoed):
    body = {"messages": messages, "add_generation_prompt": add_gen}
    plain, plain_streamed, _ = _texts(server, body)
    assert plain["role"] == role and plain_streamed == plain["content"]
    message, streamed, chunks = _texts(server, {**body, "echo": True})
    assert message["role"] == role and message["content"] == echoed + plain["content"]
    assert streamed == message["content"]
    opening = [c["choices"][0] for c in chunks[:2]]
    assert opening[0]["delta"] == {"role": role, "content": ""}
    if echoed:  # as vLLM: the echo is a chunk of its own, before any generated token
        assert opening[1]["delta"] == {"content": echoed} and opening[1]["logprobs"] is None
    assert sum(len((c["choices"][0]["logprobs"] or {}).get("content") or [])
               for c in chunks if c["choices"]) == 4
