"""Reasoning output: the deepseek_r1 parser on texts in Nemotron-Nano-v2's format (its template
opens `<think>` in the prompt, so the output is `reasoning</think>answer`; `/no_think` renders
`<think></think>`), and end to end with the openai client on the forced checkpoint, whose
template branches on `/think` and `/no_think` in the system prompt and on
chat_template_kwargs enable_thinking, as Nemotron's does."""

from __future__ import annotations

import pytest
from conftest import start_server
from test_tool_calls import forced_ckpt  # noqa: F401 - the session fixture

from mambaserve.server.reasoning_parsers import ThinkReasoningParser, reasoning_parser_class

OPEN = "<SPECIAL_11>Assistant\n<think>\n"  # how Nemotron-Nano-v2's template ends a prompt
CLOSED = "<SPECIAL_11>Assistant\n<think></think>"  # ... with /no_think


@pytest.mark.parametrize("prompt,text,want", [
    (OPEN, "Let me think.\n</think>\n\nParis.", ("Let me think.\n", "\n\nParis.")),
    (OPEN, "<think>x</think>y", ("x", "y")),  # a model that opens the block itself
    (OPEN, "still thinking", ("still thinking", "")),  # cut short: all reasoning
    (CLOSED, "Paris.", ("", "Paris.")),  # the prompt closed the block: all content
    (CLOSED, "a </think> b", ("", "a </think> b")),
    ("user: hi", "no tags at all", ("no tags at all", "")),  # vLLM's deepseek_r1 does this
])
def test_split(prompt, text, want):
    assert ThinkReasoningParser(prompt).split(text, final=True) == want


def test_enable_thinking_false_is_all_content():
    p = ThinkReasoningParser(OPEN, {"enable_thinking": False})
    assert p.split("x</think>y", final=True) == ("", "x</think>y")


@pytest.mark.parametrize("text", ["<think>ab</think>cd", "  <think>a</thi", "ab</think>",
                                  "x<", "<thinking>a</think>b", "</th</think>c"])
def test_prefixes_only_grow(text):
    """What a prefix gives is a prefix of what every longer text gives (the streaming rule)."""
    p = ThinkReasoningParser(OPEN)
    prev = ("", "")
    for n in range(len(text) + 1):
        cur = p.split(text[:n], final=n == len(text))
        assert cur[0].startswith(prev[0]) and cur[1].startswith(prev[1]), (text[:n], prev, cur)
        prev = cur


def test_unknown_name():
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning_parser_class("nope")


@pytest.fixture(scope="module")
def reasoning(forced_ckpt):  # noqa: F811
    s = start_server(forced_ckpt, reasoning_parser="deepseek_r1", tool_call_parser="nemotron_json",
                     memory_budget_bytes=32 << 20)
    yield s
    s.thread.stop()


def _messages(system: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]


def test_reasoning_content(reasoning):
    r = reasoning.client().chat.completions.create(
        model=reasoning.model, messages=_messages("Be brief. /think"), temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content == "The user wants a greeting."
    assert msg.content == "Hello there!"
    assert r.choices[0].finish_reason == "stop"


def test_reasoning_streamed(reasoning):
    stream = reasoning.client().chat.completions.create(
        model=reasoning.model, messages=_messages("/think"), temperature=0, stream=True)
    kinds, reasoning_text, content = [], "", ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = getattr(d, "reasoning_content", None) or ""
        reasoning_text += r
        content += d.content or ""
        kinds += ["r"] * bool(r) + ["c"] * bool(d.content)
    assert reasoning_text == "The user wants a greeting." and content == "Hello there!"
    assert kinds == sorted(kinds, reverse=True)  # all reasoning before any content


def test_include_reasoning_false_leaves_it_out(reasoning):
    """vLLM's include_reasoning: false: the reasoning is generated (the same content follows it)
    but not returned, whole or streamed."""
    kw = {"model": reasoning.model, "messages": _messages("/think"), "temperature": 0,
          "extra_body": {"include_reasoning": False}}
    client = reasoning.client()
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content is None and msg.content == "Hello there!"
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "Hello there!"


@pytest.mark.parametrize("kw", [
    {"messages": _messages("/no_think")},  # the system-prompt switch, through the template
    {"messages": _messages("/think"), "extra_body": {
        "chat_template_kwargs": {"enable_thinking": False}}},
])
def test_thinking_off(reasoning, kw):
    r = reasoning.client().chat.completions.create(model=reasoning.model, temperature=0, **kw)
    msg = r.choices[0].message
    assert msg.content == "Hello there!" and msg.reasoning_content is None


def test_template_kwargs_reserved_names(reasoning):
    import httpx

    r = httpx.post(reasoning.url + "/v1/chat/completions", json={
        "messages": _messages("hi"), "chat_template_kwargs": {"messages": []}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_forced_call_output_is_not_split():
    """tool_choice required / named: the constraint starts the call at the first token, so the
    output is read for calls only (no reasoning split)."""
    from mambaserve.server.chat_request import ChatConfig, parse_chat_inputs

    config = ChatConfig("nemotron_json", "deepseek_r1")
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice, split in (("auto", True), ("required", False),
                          ({"type": "function", "function": {"name": "f"}}, False)):
        chat = parse_chat_inputs({"messages": [{"role": "user", "content": "x"}],
                                  "tools": tools, "tool_choice": choice}, config)
        spec = chat.output_spec(config, OPEN)
        assert (spec.reasoning is not None) == split and spec.tool_parser is not None
