"""Tool-call parsers: the model's text -> content and OpenAI tool calls, selected with
`--tool-call-parser NAME` (vLLM's names).

- `nemotron_json`: NemotronH / Nemotron-Nano-v2's `<TOOLCALL>[{"name": ..., "arguments": {...}},
  ...]</TOOLCALL>` (the format its chat template describes to the model; vLLM loads it from the
  checkpoint's plugin file nemotron_toolcall_parser_no_streaming.py under this name).
- `hermes` (alias `granite4`): one `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  block per call, the format of Granite 4.0's chat template (and Hermes / Qwen).

A parser reads any prefix of the output (`final=False` while streaming): the content it returns
for a prefix is a prefix of the content of every longer text, and a call's `arguments` text only
grows, so streamed deltas are differences of successive parses. Text after the tool calls is
dropped, as vLLM does. A final text whose tool-call region is not well-formed JSON (or is cut
short) is returned whole as content with no calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = re.compile(r"[ \t\n\r]*")
_STRING_BODY = re.compile(r'[^"\\]*')
_PLAIN = re.compile(r'[^"{}\[\]]*')
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
ARGUMENT_KEYS = ("arguments", "parameters")


class _Invalid(Exception):
    """The tool-call region is not the format's JSON."""


@dataclass
class ToolCall:
    name: str | None  # None until the name's string is complete
    arguments: str = ""  # the arguments' JSON text so far (final: the whole object)
    complete: bool = False  # the call's object is closed


@dataclass
class ToolParse:
    content: str  # the text before the tool calls that is safe to send
    calls: list[ToolCall] = field(default_factory=list)


# ---- JSON scanning over a text that may stop anywhere ----------------------------------------
def _string_end(s: str, i: int) -> int | None:
    """s[i] is '"': the index after its closing quote, None if the text stops first."""
    j = i + 1
    while True:
        j = _STRING_BODY.match(s, j).end()
        if j >= len(s):
            return None
        if s[j] == '"':
            return j + 1
        if j + 1 >= len(s):  # a backslash at the very end
            return None
        j += 2


def _value_end(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i] (checked with json.loads), None if the text
    stops first; _Invalid if it is not JSON."""
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        end = _string_end(s, i)
        if end is None:
            return None
    elif c in "{[":
        depth, j = 0, i
        end = None
        while True:
            j = _PLAIN.match(s, j).end()  # jump to the next quote or bracket
            if j >= len(s):
                return None
            ch = s[j]
            if ch == '"':
                j = _string_end(s, j)
                if j is None:
                    return None
                continue
            depth += 1 if ch in "{[" else -1
            j += 1
            if depth == 0:
                end = j
                break
    else:
        m = _SCALAR.match(s, i)
        if m is None or m.end() == i:
            if any(w.startswith(s[i:]) for w in ("true", "false", "null")) or s[i:] == "-":
                return None
            raise _Invalid()
        if m.end() >= len(s):
            return None  # a number may go on
        end = m.end()
    try:
        json.loads(s[i:end])
    except ValueError:
        raise _Invalid() from None
    return end


def _skip_ws(s: str, i: int) -> int:
    return _WS.match(s, i).end()


def _scan_call(s: str, i: int, calls: list[ToolCall]) -> int | None:
    """A call object {"name": "...", "arguments": {...}} at s[i] ('{'); appends it to `calls`
    (partial while the text stops inside it). The index after it, None if the text stops."""
    call = ToolCall(None)
    calls.append(call)
    j = _skip_ws(s, i + 1)
    if j < len(s) and s[j] == "}":
        raise _Invalid()  # no name
    while True:
        if j >= len(s):
            return None
        if s[j] != '"':
            raise _Invalid()
        k = _string_end(s, j)
        if k is None:
            return None
        key = json.loads(s[j:k])
        j = _skip_ws(s, k)
        if j >= len(s):
            return None
        if s[j] != ":":
            raise _Invalid()
        v = _skip_ws(s, j + 1)
        if v >= len(s):
            return None
        end = _value_end(s, v)
        if key == "name":
            if s[v] != '"':
                raise _Invalid()
            if end is None:
                return None
            call.name = json.loads(s[v:end])
        elif key in ARGUMENT_KEYS:
            if end is None:
                if s[v] == "{":
                    call.arguments = s[v:]  # streamable: the raw object so far
                return None
            call.arguments = _arguments_text(s[v:end])
        elif end is None:
            return None
        j = _skip_ws(s, end)
        if j >= len(s):
            return None
        if s[j] == "}":
            if call.name is None:
                raise _Invalid()
            call.complete = True
            if not call.arguments:
                call.arguments = "{}"
            return j + 1
        if s[j] != ",":
            raise _Invalid()
        j = _skip_ws(s, j + 1)


def _arguments_text(raw: str) -> str:
    """The arguments as OpenAI sends them (a JSON object's text): an object as written; a
    JSON string holding an object (some models quote the arguments) decoded."""
    if raw.startswith("{"):
        return raw
    value = json.loads(raw)
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except ValueError:
            pass
    raise _Invalid()


def _partial_tag(s: str, tag: str) -> int:
    """Length of the longest suffix of `s` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-n:]):
            return n
    return 0


# ---- the parsers -----------------------------------------------------------------------------
def _scan_list(s: str, j: int, calls: list[ToolCall]) -> int | None:
    """A JSON list of call objects at s[j] ('['): the index after it, None if the text stops."""
    if s[j] != "[":
        raise _Invalid()
    j = _skip_ws(s, j + 1)
    while True:
        if j >= len(s):
            return None
        if s[j] != "{":
            raise _Invalid()  # an empty list is no tool call either
        j = _scan_call(s, j, calls)
        if j is None:
            return None
        j = _skip_ws(s, j)
        if j >= len(s):
            return None
        if s[j] == "]":
            return j + 1
        if s[j] != ",":
            raise _Invalid()
        j = _skip_ws(s, j + 1)


def _expect(s: str, j: int, tag: str) -> int | None:
    """After optional whitespace, `tag` (or the end of the text, or `tag` cut by it): the index
    after it, None if the text stops; _Invalid if something else follows."""
    j = _skip_ws(s, j)
    if s.startswith(tag, j):
        return j + len(tag)
    if tag.startswith(s[j:]):
        return None
    raise _Invalid()


class ToolParser:
    """Content is the text before `start`; the calls are scanned from there by `_scan`. A
    final parse needs at least one call, every call closed."""

    start = ""

    def parse(self, text: str, final: bool) -> ToolParse:
        idx = text.find(self.start)
        if idx < 0:
            if final:
                return ToolParse(text)
            safe = text[:len(text) - _partial_tag(text, self.start)]
            return ToolParse(safe.rstrip())  # trailing space may precede a tool call
        calls: list[ToolCall] = []
        try:
            self._scan(text, idx + len(self.start), calls)
        except _Invalid:
            return ToolParse(text)
        if final and (not calls or not all(c.complete for c in calls)):
            return ToolParse(text)
        return ToolParse(text[:idx].rstrip(), calls)

    def _scan(self, s: str, i: int, calls: list[ToolCall]) -> None:
        raise NotImplementedError


class NemotronJSONParser(ToolParser):
    start, end = "<TOOLCALL>", "</TOOLCALL>"

    def _scan(self, s: str, i: int, calls: list[ToolCall]) -> None:
        j = _skip_ws(s, i)
        if j < len(s) and (j := _scan_list(s, j, calls)) is not None:
            _expect(s, j, self.end)  # what follows the end tag is dropped


class HermesParser(ToolParser):
    start, end = "<tool_call>", "</tool_call>"

    def _scan(self, s: str, i: int, calls: list[ToolCall]) -> None:
        while True:
            j = _skip_ws(s, i)
            if j >= len(s):
                return
            if s[j] != "{":
                raise _Invalid()
            j = _scan_call(s, j, calls)
            if j is None or (j := _expect(s, j, self.end)) is None:
                return
            i = _skip_ws(s, j)
            if not s.startswith(self.start, i):
                return  # anything after the last block is dropped
            i += len(self.start)


class JSONListParser(ToolParser):
    """No tool-call format (no --tool-call-parser): tool_choice "required" generates a JSON list
    [{"name": ..., "parameters": {...}}, ...] under a JSON-schema constraint, as vLLM does."""

    def _scan(self, s: str, i: int, calls: list[ToolCall]) -> None:
        j = _skip_ws(s, i)
        if j < len(s) and (j := _scan_list(s, j, calls)) is not None and s[j:].strip():
            raise _Invalid()


class NamedArgumentsParser(ToolParser):
    """A named tool_choice without a tool-call format: the whole output is the arguments
    object (generated under the tool's parameters schema), the name is the chosen one."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        body = text.lstrip()
        if not final:
            return ToolParse("", [ToolCall(self.name, body)])
        try:
            end = _value_end(body, 0)
        except _Invalid:
            end = None
        if end is None or not body.startswith("{") or body[end:].strip():
            return ToolParse(text)
        return ToolParse("", [ToolCall(self.name, body[:end], True)])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "nemotron_json": NemotronJSONParser,
    "hermes": HermesParser,
    "granite4": HermesParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError listing the names otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return cls()
