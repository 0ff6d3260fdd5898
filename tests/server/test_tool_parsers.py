"""The tool-call parsers and the chat output assembly on texts in the families' real formats:

- nemotron_json: Nemotron-Nano-9B-v2's chat template tells the model to answer
  `<TOOLCALL>[{"name": ..., "arguments": ...}, ...]</TOOLCALL>` and writes earlier calls as
  `<TOOLCALL>[{"name": "f", "arguments": {...}}, {...}]</TOOLCALL>` (tojson separators); its
  thinking block precedes it (`...</think>` then the call).
- hermes: Granite 4.0's template asks for `<tool_call>\\n{"name": <function-name>,
  "arguments": <args-json-object>}\\n</tool_call>` per call (IBM's prompt guide; vLLM served
  Granite 4 with its hermes parser). Granite sometimes quotes the arguments object as a JSON
  string (vLLM's granite4 parser notes it); that is decoded.

Streaming is checked by feeding every prefix: the deltas concatenate to the final message.
"""

from __future__ import annotations

import json

import pytest

from mambaserve.server.chat_output import ChatChoiceOutput, ChatOutputSpec
from mambaserve.server.reasoning_parsers import ThinkReasoningParser
from mambaserve.server.tool_parsers import (
    JSONListParser,
    NamedArgumentsParser,
    get_tool_parser,
)

NEMOTRON = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"location": "Paris, France", '
            '"unit": "celsius"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'
            '</TOOLCALL>')
NEMOTRON_CALLS = [("get_weather", {"location": "Paris, France", "unit": "celsius"}),
                  ("get_time", {"tz": "Europe/Paris"})]
HERMES = ('<tool_call>\n{"name": "get_stock_price", "arguments": {"ticker": "IBM", '
          '"nested": {"a": [1, 2.5e-3, true, null], "s": "quote \\" and \\\\ }]"}}}\n'
          '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
HERMES_CALLS = [("get_stock_price", {"ticker": "IBM", "nested": {
    "a": [1, 2.5e-3, True, None], "s": 'quote " and \\ }]'}}), ("noop", {})]


def _calls(parse):
    return [(c.name, json.loads(c.arguments)) for c in parse.calls]


@pytest.mark.parametrize("name,text,want", [
    ("nemotron_json", NEMOTRON, NEMOTRON_CALLS),
    ("nemotron_json", "Sure.\n\n" + NEMOTRON + "\n", NEMOTRON_CALLS),
    ("hermes", HERMES, HERMES_CALLS),
    ("granite4", HERMES, HERMES_CALLS),
    # Granite quoting its arguments; no end tag (generation stopped at EOS)
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}', [("f", {"x": 1})]),
    ("hermes", '<tool_call>\n{"name": "f", "parameters": {"x": 1}}\n</tool_call> bye',
     [("f", {"x": 1})]),  # text after the calls is dropped, as vLLM does
])
def test_final_parse(name, text, want):
    parse = get_tool_parser(name).parse(text, final=True)
    assert _calls(parse) == want
    assert parse.content == text[:text.find("<")].rstrip()


@pytest.mark.parametrize("name,text", [
    ("nemotron_json", "<TOOLCALL>[]</TOOLCALL>"),
    ("nemotron_json", '<TOOLCALL>[{"arguments": {}}]</TOOLCALL>'),  # no name
    ("nemotron_json", '<TOOLCALL>[{"name": "f", "arguments": {"a": }}]</TOOLCALL>'),
    ("nemotron_json", '<TOOLCALL>[{"name": "f", "arguments": {"a": 1}'),  # cut short
    ("nemotron_json", '<TOOLCALL>{"name": "f"}</TOOLCALL>'),  # not a list
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", "I would call <tool_call but did not"),
])
def test_malformed_is_content(name, text):
    parse = get_tool_parser(name).parse(text, final=True)
    assert parse.calls == [] and parse.content == text


def test_unknown_parser():
    with pytest.raises(ValueError, match="nemotron_json"):
        get_tool_parser("mistral")


def _stream(spec: ChatOutputSpec, text: str) -> tuple[dict, list[dict]]:
    """Every prefix fed as the stream sees it -> (accumulated message, deltas)."""
    out = ChatChoiceOutput(spec)
    deltas = [out.delta(text[:n], final=n == len(text)) for n in range(1, len(text) + 1)]
    acc: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        acc["content"] += d.get("content", "")
        acc["reasoning_content"] += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            slot = acc["tool_calls"].setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert slot["name"] is None and tc["type"] == "function"
                slot["name"], slot["id"] = tc["function"]["name"], tc["id"]
            slot["arguments"] += tc.get("function", {}).get("arguments", "")
    return acc, [d for d in deltas if d]


@pytest.mark.parametrize("name,text", [("nemotron_json", "Checking.\n" + NEMOTRON),
                                       ("hermes", HERMES), ("hermes", "no call here")])
def test_streamed_deltas_add_up_to_the_message(name, text):
    spec = ChatOutputSpec(get_tool_parser(name))
    acc, deltas = _stream(spec, text)
    msg, called = ChatChoiceOutput(spec).message(text)
    assert acc["content"] == (msg["content"] or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in acc["tool_calls"].values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"]))
         for c in msg["tool_calls"]]
    assert called == bool(msg["tool_calls"])
    if called:  # the arguments of the first call came in more than one chunk
        assert sum(1 for d in deltas for tc in d.get("tool_calls", [])
                   if tc["index"] == 0 and "id" not in tc) > 1


def test_reasoning_then_tool_call():
    """Nemotron thinking, then calling: the tool parser reads the text after </think>."""
    text = "The user wants the weather.\n</think>\n\n" + NEMOTRON
    spec = ChatOutputSpec(get_tool_parser("nemotron_json"),
                          ThinkReasoningParser("<SPECIAL_11>Assistant\n<think>\n"))
    msg, called = ChatChoiceOutput(spec).message(text)
    assert called and msg["content"] is None
    assert msg["reasoning_content"] == "The user wants the weather.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == NEMOTRON_CALLS
    acc, _ = _stream(spec, text)
    assert acc["reasoning_content"] == msg["reasoning_content"] and acc["content"] == ""
    assert len(acc["tool_calls"]) == 2


def test_no_format_parsers():
    """Without --tool-call-parser, forced calls are plain JSON (vLLM's way)."""
    parse = JSONListParser().parse('[{"name": "f", "parameters": {"x": 1}}, '
                                   '{"name": "g", "parameters": {}}]', final=True)
    assert _calls(parse) == [("f", {"x": 1}), ("g", {})] and parse.content == ""
    assert JSONListParser().parse("[] trailing", final=True).calls == []
    parse = NamedArgumentsParser("f").parse(' {"x": [1, 2]}', final=True)
    assert _calls(parse) == [("f", {"x": [1, 2]})]
    assert NamedArgumentsParser("f").parse('{"x": ', final=True).calls == []
