"""The constraint tool_choice "required" / a named function builds (tool_choice.py): the EBNF
grammar of the format (compiled back from its text, as constrained decoding compiles a
StructuredOutput "grammar") accepts the calls the format allows and refuses the others; without
a format, the JSON schema vLLM uses. Checked with xgrammar's own matcher. Enforcing it while
decoding is constrained decoding's job (tested there)."""

from __future__ import annotations

import json

import pytest

from mambaserve.server.fields import APIError
from mambaserve.server.tool_choice import constraint, parse_tools

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
]


def _grammar(parser, choice, parallel=True):
    req = parse_tools({"tools": TOOLS, "tool_choice": choice,
                       "parallel_tool_calls": parallel}, parser)
    so = constraint(req, parser)
    assert so.kind == ("grammar" if parser else "json_schema")
    if parser:
        return xgr.Grammar.from_ebnf(so.spec)
    return xgr.Grammar.from_json_schema(so.spec)


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
W2 = '{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}'
NOW = '{"name": "now", "arguments": {}}'


@pytest.mark.parametrize("choice,parallel,good,bad", [
    ("required", True,
     [f"<TOOLCALL>[{W}]</TOOLCALL>", f"<TOOLCALL>[{W}, {NOW}, {W2}]</TOOLCALL>"],
     ["<TOOLCALL>[]</TOOLCALL>", f"[{W}]", f"<TOOLCALL>[{W}]",
      '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": 5}}]</TOOLCALL>',
      '<TOOLCALL>[{"name": "get_weather", "arguments": {"days": 1}}]</TOOLCALL>',
      '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "a", "x": 1}}]</TOOLCALL>',
      '<TOOLCALL>[{"name": "other", "arguments": {}}]</TOOLCALL>', "plain text"]),
    ("required", False, [f"<TOOLCALL>[{NOW}]</TOOLCALL>"],
     [f"<TOOLCALL>[{W}, {NOW}]</TOOLCALL>"]),
    ({"type": "function", "function": {"name": "get_weather"}}, True,
     [f"<TOOLCALL>[{W2}]</TOOLCALL>"],
     [f"<TOOLCALL>[{NOW}]</TOOLCALL>", f"<TOOLCALL>[{W}, {W}]</TOOLCALL>"]),
])
def test_nemotron_grammar(choice, parallel, good, bad):
    g = _grammar("nemotron_json", choice, parallel)
    for s in good:
        assert _is_grammar_accept_string(g, s), s
    for s in bad:
        assert not _is_grammar_accept_string(g, s), s


def test_hermes_grammar():
    g = _grammar("hermes", "required")
    one = f"<tool_call>\n{W}\n</tool_call>"
    assert _is_grammar_accept_string(g, one)
    assert _is_grammar_accept_string(g, one + f"\n<tool_call>\n{NOW}\n</tool_call>")
    assert not _is_grammar_accept_string(g, W)
    assert not _is_grammar_accept_string(g, f"<tool_call>\n{W}</tool_call>")
    g1 = _grammar("hermes", "required", parallel=False)
    assert not _is_grammar_accept_string(g1, one + f"\n<tool_call>\n{NOW}\n</tool_call>")


def test_parsers_read_what_the_grammar_allows():
    """A string the grammar accepts is parsed into the same calls (grammar and parser agree)."""
    from mambaserve.server.tool_parsers import get_tool_parser

    text = f"<TOOLCALL>[{W}, {NOW}]</TOOLCALL>"
    assert _is_grammar_accept_string(_grammar("nemotron_json", "required"), text)
    calls = get_tool_parser("nemotron_json").parse(text, final=True).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]


def test_no_format_uses_json():
    g = _grammar(None, "required")
    assert _is_grammar_accept_string(g, '[{"name": "now", "parameters": {}}]')
    assert _is_grammar_accept_string(
        g, '[{"name": "get_weather", "parameters": {"city": "x"}}, '
           '{"name": "now", "parameters": {"a": 1}}]')
    assert not _is_grammar_accept_string(g, "[]")
    assert not _is_grammar_accept_string(g, '[{"name": "get_weather", "parameters": {}}]')
    named = _grammar(None, {"type": "function", "function": {"name": "get_weather"}})
    assert _is_grammar_accept_string(named, '{"city": "Oslo", "days": 2}')
    assert not _is_grammar_accept_string(named, '{"days": 2}')


def test_auto_and_none_build_nothing():
    for choice in ("auto", "none"):
        assert constraint(parse_tools({"tools": TOOLS, "tool_choice": choice},
                                      "nemotron_json"), "nemotron_json") is None


def test_a_schema_xgrammar_refuses_is_a_400():
    req = parse_tools({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "x": {"$ref": "#/definitions/missing"}}}}}], "tool_choice": "required"},
        "nemotron_json")
    with pytest.raises(APIError) as e:
        constraint(req, "nemotron_json")
    assert e.value.status == 400 and e.value.param == "tools"
