"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request: checked, turned into the
parser that reads the output, and for "required" or a named function into the constraint that
enforces a call through constrained decoding (SamplingParams.structured_output).

With a tool-call format (--tool-call-parser) the constraint is the format itself, as an EBNF
grammar in xgrammar's syntax: e.g. for nemotron_json `<TOOLCALL>[` one or more (one with
parallel_tool_calls false) `{"name": "NAME", "arguments": ARGS}` separated by `, `, then
`]</TOOLCALL>`, where ARGS follows that tool's parameters JSON schema. It is built with
xgrammar's structural tags and printed as EBNF (xgrammar is the structured-output extra).
Without a format the constraint is vLLM's: the named tool's parameters schema (the output is the
arguments object), or for "required" a JSON list of {"name", "parameters"} objects.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mambaserve.engine.sampling_params import StructuredOutput
from mambaserve.server.fields import APIError, _describe, _type_error, get_bool
from mambaserve.server.tool_parsers import (
    JSONListParser,
    NamedArgumentsParser,
    ToolParser,
    get_tool_parser,
)

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and dots, as vLLM)
MAX_TOOLS = 128
MAX_WHITESPACE = 4  # whitespace run allowed inside constrained JSON (no endless newlines)


@dataclass
class ToolRequest:
    tools: list[dict]  # the OpenAI tool definitions, as the chat template gets them
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None  # the function tool_choice names
    parallel: bool

    def schema(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)


def _bad(msg: str, param: str) -> APIError:
    return APIError(msg, param=param, code="invalid_value")


def parse_tools(body: dict, parser_name: str | None) -> ToolRequest | None:
    """The request's tools and tool_choice (None without tools); a 400 naming the field when
    they are malformed, or when "auto" is asked of a server started without a tool-call
    parser (as vLLM answers)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = get_bool(body, "parallel_tool_calls", True)
    if body.get("functions") or body.get("function_call"):
        name = "functions" if body.get("functions") else "function_call"
        raise APIError(f"'{name}' (the deprecated function-calling API) is not supported; send "
                       "'tools' and 'tool_choice'", param=name, code="unsupported_parameter")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _type_error("tools", "an array of tools", tools)
    if len(tools) > MAX_TOOLS:
        raise _bad(f"'tools' takes at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    names = []
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise _type_error(p, "an object", t)
        if t.get("type") != "function":
            raise APIError(f"{p}.type must be \"function\" (the only tool type this server "
                           f"runs), got {_describe(t.get('type'))}", param=f"{p}.type",
                           code="unsupported_parameter")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise _type_error(f"{p}.function", "an object", fn)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise _bad(f"{p}.function.name must be 1-64 letters, digits, '_', '-' or '.', got "
                       f"{_describe(name)}", f"{p}.function.name")
        if name in names:
            raise _bad(f"two tools are named {name!r}", f"{p}.function.name")
        names.append(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _type_error(f"{p}.function.parameters", "a JSON schema object", params)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _type_error(f"{p}.function.description", "a string", fn["description"])
    named = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise _bad('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                       "tool_choice")
        named = fn["name"]
        if named not in names:
            raise _bad(f"tool_choice names {named!r}, which is not one of the tools",
                       "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise _bad("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                   f"{_describe(choice)}", "tool_choice")
    if choice == "required" and not tools:
        raise _bad("tool_choice \"required\" needs at least one tool", "tool_choice")
    if choice == "auto" and tools and parser_name is None:
        raise APIError('tool_choice "auto" needs a server started with --tool-call-parser '
                       '(and --enable-auto-tool-choice, as vLLM)', param="tool_choice",
                       code="unsupported_parameter")
    return ToolRequest([dict(t) for t in tools], choice, named, parallel)


def output_parser(req: ToolRequest | None, parser_name: str | None) -> ToolParser | None:
    """The parser that reads this request's output into tool calls (None: plain content)."""
    if req is None or req.choice == "none" or not req.tools:
        return None
    if parser_name is not None:
        return get_tool_parser(parser_name)
    if req.choice == "named":
        return NamedArgumentsParser(req.named)
    return JSONListParser()  # "required" without a format


def constraint(req: ToolRequest | None, parser_name: str | None) -> StructuredOutput | None:
    """The structured-output constraint that enforces a call ("required", named), else None."""
    if req is None or req.choice not in ("required", "named"):
        return None
    names = [req.named] if req.choice == "named" else \
        [t["function"]["name"] for t in req.tools]
    one = req.choice == "named" or not req.parallel
    if parser_name is None:
        if req.choice == "named":
            return StructuredOutput("json_schema", json.dumps(req.schema(req.named)))
        items = [{"type": "object", "properties": {"name": {"const": n},
                                                   "parameters": req.schema(n)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n in names]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if one:
            schema["maxItems"] = 1
        return StructuredOutput("json_schema", json.dumps(schema))
    return StructuredOutput("grammar", tool_call_grammar(parser_name, req, names, one))


def _call_tags(req: ToolRequest, names: list[str], end: str) -> list[dict]:
    return [{"type": "tag", "begin": '{"name": ' + json.dumps(n) + ', "arguments": ',
             "content": {"type": "json_schema", "json_schema": req.schema(n),
                         "max_whitespace_cnt": MAX_WHITESPACE},
             "end": "}" + end} for n in names]


def tool_call_grammar(parser_name: str, req: ToolRequest, names: list[str], one: bool) -> str:
    """EBNF (xgrammar's syntax) of one call (`one`) or one or more calls of `names` in the
    format of `parser_name`, each call's arguments following its tool's parameters schema."""
    parser = get_tool_parser(parser_name)
    if parser_name == "nemotron_json":
        calls = {"type": "tags_with_separator", "tags": _call_tags(req, names, ""),
                 "separator": ", ", "at_least_one": True, "stop_after_first": one}
        fmt = {"type": "sequence", "elements": [
            {"type": "const_string", "value": parser.start + "["}, calls,
            {"type": "const_string", "value": "]" + parser.end}]}
    else:  # hermes: <tool_call>\n{...}\n</tool_call> blocks, one per line
        tags = [dict(t, begin=parser.start + "\n" + t["begin"])
                for t in _call_tags(req, names, "\n" + parser.end)]
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": one}
    try:
        import xgrammar
    except ImportError:
        raise APIError(f'tool_choice "{req.choice}" is enforced through structured output, '
                       'which needs the xgrammar package: pip install "mambaserve[structured]"',
                       param="tool_choice", code="unsupported_parameter") from None
    try:
        grammar = xgrammar.Grammar.from_structural_tag(
            json.dumps({"type": "structural_tag", "format": fmt}))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
        raise APIError(f"a tool's parameters are not a JSON schema this server can enforce: "
                       f"{str(e).splitlines()[0][:300]}", param="tools",
                       code="invalid_value") from None
    return str(grammar)
