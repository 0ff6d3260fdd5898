"""Tool calling end to end with the official openai client, streamed and not, on the forced
checkpoint (forced_checkpoint.py): the engine really generates `<TOOLCALL>[...]</TOOLCALL>`
(nemotron_json) or `<tool_call>...</tool_call>` (hermes) token by token, and the server reads
it into tool_calls. What this covers: the request side (tools and tool messages through the
chat template), the parsers on real generations at token boundaries, the response and delta
shapes, finish_reason. What it does not: whether a real Nemotron / Granite checkpoint emits
these formats (the parsers' unit tests use the formats as the families' templates write them).
tool_choice "required" / a named function is enforced by constrained decoding: on a prompt the
model answers in plain text, the constrained output is still a valid call (test_tool_choice.py
tests the grammar itself)."""

from __future__ import annotations

import json

import pytest
from conftest import start_server
from forced_checkpoint import EXPECTED, make_forced_checkpoint

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ARITH = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
    for n in ("add", "mul")]
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="session")
def forced_ckpt(tmp_path_factory):
    return make_forced_checkpoint(tmp_path_factory.mktemp("forced") / "ckpt")


@pytest.fixture(scope="module")
def nemotron(forced_ckpt):
    s = start_server(forced_ckpt, tool_call_parser="nemotron_json",
                     memory_budget_bytes=32 << 20)
    yield s
    s.thread.stop()


@pytest.fixture(scope="module")
def hermes(forced_ckpt):
    s = start_server(forced_ckpt, tool_call_parser="hermes", memory_budget_bytes=32 << 20)
    yield s
    s.thread.stop()


def _ask(selector: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in Paris? {selector}"}]


def _streamed(server, **kw):
    """(final completion accumulated by the openai library's own stream helper, raw chunks)."""
    client = server.client()
    with client.chat.completions.stream(model=server.model, **kw) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    return final, chunks


def test_single_call(nemotron):
    r = nemotron.client().chat.completions.create(
        model=nemotron.model, messages=_ask("1"), tools=[WEATHER], temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Let me check."
    [call] = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_single_call_streamed(nemotron):
    final, chunks = _streamed(nemotron, messages=_ask("1"), tools=[WEATHER], temperature=0)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    # announced once with id, type and name, then the arguments. Outputs that pile up while the
    # client reads are sent as one chunk (engine/request_stream.py), so on a fast machine the
    # announcement may carry the first arguments too; the parse of every prefix of the text,
    # token by token, is test_tool_parsers.py's
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == '{"city": "Paris"}'
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    msg = final.choices[0].message  # the openai library's accumulation of the deltas
    assert msg.content == "Let me check."
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_calls(nemotron, stream):
    kw = {"messages": _ask("2"), "tools": ARITH, "temperature": 0}
    if stream:
        final, chunks = _streamed(nemotron, **kw)
        indexes = [tc.index for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls
                   or []]
        assert sorted(set(indexes)) == [0, 1] and indexes == sorted(indexes)
    else:
        final = nemotron.client().chat.completions.create(model=nemotron.model, **kw)
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls]
    assert got == [("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": 4})]
    assert len({c.id for c in ch.message.tool_calls}) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_hermes_format(hermes, stream):
    kw = {"messages": _ask("3"), "tools": [TIME], "temperature": 0}
    final = _streamed(hermes, **kw)[0] if stream else \
        hermes.client().chat.completions.create(model=hermes.model, **kw)
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    [call] = ch.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time",
                                                                        {"tz": "UTC"})


@pytest.mark.parametrize("stream", [False, True])
def test_no_call_and_malformed_call_are_content(nemotron, stream):
    for sel in ("4", "5"):  # plain text; a call whose JSON is broken
        kw = {"messages": _ask(sel), "tools": [WEATHER], "temperature": 0}
        final = _streamed(nemotron, **kw)[0] if stream else \
            nemotron.client().chat.completions.create(model=nemotron.model, **kw)
        ch = final.choices[0]
        assert ch.finish_reason == "stop"
        assert ch.message.content == EXPECTED[sel]
        if not stream or sel == "4":
            assert not ch.message.tool_calls
        elif ch.message.tool_calls:  # streamed, announced before the call was known broken
            assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
        # (else the whole broken call reached the parser in one piled-up chunk: never announced)


def test_tool_choice_none_reads_no_calls(nemotron):
    r = nemotron.client().chat.completions.create(
        model=nemotron.model, messages=_ask("1"), tools=[WEATHER], tool_choice="none",
        temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == EXPECTED["1"]


UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "set_unit"}}])
def test_forced_tool_choice_turns_plain_text_into_a_call(nemotron, choice, stream):
    kw = {"messages": _ask("4"), "tools": [WEATHER, UNIT], "tool_choice": choice,
          "temperature": 0, "max_tokens": 200}  # "4": the model answers in plain text
    final = _streamed(nemotron, **kw)[0] if stream else \
        nemotron.client().chat.completions.create(model=nemotron.model, **kw)
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.tool_calls
    for call in ch.message.tool_calls:
        args = json.loads(call.function.arguments)
        if call.function.name == "set_unit":
            assert set(args) == {"unit"} and args["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "get_weather" and isinstance(args["city"], str)
    if choice != "required":
        assert {c.function.name for c in ch.message.tool_calls} == {"set_unit"}


def test_tool_messages_go_through_the_template(nemotron):
    """A full round: the assistant's tool_calls and the tool's answer are rendered by the
    chat template (this template writes them out; /tokenize shows the prompt)."""
    call = {"id": "call_abc", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = _ask("1") + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny 4"}]
    import httpx

    r = httpx.post(nemotron.url + "/tokenize", json={"messages": messages, "tools": [WEATHER],
                                                     "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = "".join(r.json()["token_strs"])
    assert 'calls=[{"type": "function", "function": {"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}, "id": "call_abc"}]' in prompt  # arguments as an object
    assert "tool: sunny 4 id=call_abc" in prompt and "tools: get_weather" in prompt
    # the prompt ends with the tool message's last character ("4"): the plain-text chain
    out = nemotron.client().chat.completions.create(
        model=nemotron.model, messages=messages, tools=[WEATHER], temperature=0)
    assert out.choices[0].message.content == EXPECTED["4"]


BAD_TOOLS = [
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("extra,param", BAD_TOOLS)
def test_bad_tool_requests_are_400(nemotron, extra, param):
    import httpx

    body = {"messages": _ask("1"), **extra}
    r = httpx.post(nemotron.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_auto_needs_a_parser(server):
    """The shared server has no --tool-call-parser: tool_choice auto is refused (as vLLM)."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert e.value.body["param"] == "tool_choice"
    assert "--tool-call-parser" in e.value.body["message"]
