"""The request fields that constrain or reshape sampling, checked and mapped to SamplingParams
fields, for both /v1/completions and /v1/chat/completions:

- structured output: OpenAI's `response_format` ({"type": "text" | "json_object" |
  "json_schema", "json_schema": {"name", "schema", "strict"}}), vLLM's `structured_outputs`
  ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}, its field since the
  `guided_*` ones were removed) and the older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` -> `StructuredOutput` (at most one of them per request). Whether the
  schema / pattern / grammar compiles is the engine's check when it admits the request (a 400
  as well);
- `logit_bias` ({"token id": bias in [-100, 100]}, OpenAI), `presence_penalty` /
  `frequency_penalty` ([-2, 2], OpenAI), `repetition_penalty` (vLLM; 1 = off);
- `allowed_token_ids` (vLLM): sampling only ever picks one of these ids (a fixed token mask;
  not together with structured output);
- `bad_words` (vLLM): an array of words the generated text must not contain
  (structured/bad_words.py says how a word becomes token sequences).

Errors are `FieldError`s (a ValueError naming the parameter); server/protocol.py turns them into
400 answers. This module imports nothing from the server, so protocol.py can import it.
"""

from __future__ import annotations

import json
import math

from mambaserve.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    PENALTY_RANGE,
    REPETITION_RANGE,
    StructuredOutput,
)

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# vLLM's structured_outputs: its constraints (exactly one per request), and its options that
# would change the text and are not implemented (backend and whitespace options that only
# restate what this server does are ignored)
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
STRUCTURED_OUTPUTS_UNSUPPORTED = ("structural_tag", "whitespace_pattern")


class FieldError(ValueError):
    """A request field with a bad value; `param` names it (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def sampling_extras(body: dict, vocab_size: int) -> dict:
    """SamplingParams keyword arguments for the fields above (defaults when absent)."""
    return {"structured_output": structured_output(body),
            "logit_bias": logit_bias(body, vocab_size),
            "allowed_token_ids": allowed_token_ids(body, vocab_size),
            "bad_words": bad_words(body),
            "presence_penalty": _number(body, "presence_penalty", 0.0, -PENALTY_RANGE,
                                        PENALTY_RANGE),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0, -PENALTY_RANGE,
                                         PENALTY_RANGE),
            "repetition_penalty": _number(body, "repetition_penalty", 1.0, *REPETITION_RANGE)}


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {"str": "a string", "list": "an array", "dict": "an object"}.get(
        type(v).__name__, type(v).__name__)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FieldError(f"'{name}' must be a number, got {_kind(v)}", name, "invalid_type")
    if not math.isfinite(v) or not lo <= v <= hi:
        raise FieldError(f"'{name}' must be in [{lo:g}, {hi:g}], got {v:g}", name)
    return float(v)


def allowed_token_ids(body: dict, vocab_size: int) -> list[int] | None:
    """vLLM's `allowed_token_ids`: a non-empty array of token ids inside the vocabulary; None
    when absent or empty (no restriction)."""
    v = body.get("allowed_token_ids")
    if v is None or v == []:
        return None
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in v):
        raise FieldError(f"'allowed_token_ids' must be an array of token ids, got {_kind(v)}",
                         "allowed_token_ids", "invalid_type")
    for t in v:
        if not 0 <= t < vocab_size:
            raise FieldError(f"'allowed_token_ids' token id {t} is outside the vocabulary "
                             f"(size {vocab_size})", "allowed_token_ids")
    return list(v)


def bad_words(body: dict) -> list[str] | None:
    """vLLM's `bad_words`: an array of non-empty strings; None when absent or empty."""
    v = body.get("bad_words")
    if v is None or v == []:
        return None
    if not isinstance(v, list) or any(not isinstance(w, str) for w in v):
        raise FieldError(f"'bad_words' must be an array of strings, got {_kind(v)}",
                         "bad_words", "invalid_type")
    if any(not w.strip() for w in v):
        raise FieldError("'bad_words' entries must not be empty or only whitespace",
                         "bad_words")
    return list(v)


def logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """{"token id": bias} (JSON keys are strings) -> {token id: bias}; None when empty."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise FieldError(f"'logit_bias' must be an object mapping token ids to biases, got "
                         f"{_kind(v)}", "logit_bias", "invalid_type")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise FieldError(f"'logit_bias' keys must be token ids (decimal integers), got "
                             f"{key[:40]!r}", "logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise FieldError(f"'logit_bias' token id {token} is outside the vocabulary (size "
                             f"{vocab_size})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            shown = f"{bias:g}" if isinstance(bias, (int, float)) and not isinstance(
                bias, bool) else _kind(bias)
            raise FieldError(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {shown} for token {token}", "logit_bias")
        out[token] = float(bias)
    return out or None


def _utf8(s: str, name: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(f"'{name}' is not valid Unicode: it holds a lone surrogate at "
                         f"character {e.start}", name) from None
    return s


def structured_output(body: dict) -> StructuredOutput | None:
    """The one constraint the request asks for (None: free text)."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = _response_format(body)
    if rf is not None:
        found.append(("response_format", rf))
    for name in GUIDED_FIELDS:
        if body.get(name) is not None:
            found.append((name, _guided(name[len("guided_"):], body[name], name)))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise FieldError(f"only one structured-output field may be given, got {names}",
                         found[1][0])
    return found[0][1] if found else None


def _response_format(body: dict) -> StructuredOutput | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise FieldError(f"'response_format' must be an object, got {_kind(rf)}",
                         "response_format", "invalid_type")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        shown = repr(kind[:40]) if isinstance(kind, str) else _kind(kind)
        raise FieldError(f"'response_format.type' must be one of "
                         f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {shown}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise FieldError("'response_format' of type json_schema needs a 'json_schema' object "
                         '({"name": ..., "schema": {...}})', "response_format")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise FieldError(f"'response_format.json_schema.schema' must be a JSON schema object, "
                         f"got {_kind(schema)}", "response_format")
    for key, typ, want in (("name", str, "a string"), ("strict", bool, "a boolean")):
        if js.get(key) is not None and not isinstance(js[key], typ):
            raise FieldError(f"'response_format.json_schema.{key}' must be {want}, got "
                             f"{_kind(js[key])}", "response_format", "invalid_type")
    return StructuredOutput("json_schema",
                            _utf8(json.dumps(schema, ensure_ascii=False), "response_format"))


def _structured_outputs(v) -> StructuredOutput:
    """vLLM's `structured_outputs` object: exactly one constraint."""
    name = "structured_outputs"
    if not isinstance(v, dict):
        raise FieldError(f"'{name}' must be an object, got {_kind(v)}", name, "invalid_type")
    for key in STRUCTURED_OUTPUTS_UNSUPPORTED:
        if v.get(key) is not None:
            raise FieldError(f"'{name}.{key}' is not supported by this server", name,
                             "unsupported_parameter")
    kinds = [k for k in STRUCTURED_OUTPUTS_KINDS if v.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise FieldError(f"'{name}' takes exactly one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}"
                         f", got {', '.join(kinds) or 'none'}", name)
    kind = kinds[0]
    if kind == "json_object":
        if v[kind] is not True:
            raise FieldError(f"'{name}.json_object' must be true, got {_kind(v[kind])}", name,
                             "invalid_type")
        return StructuredOutput("json_object")
    return _guided(kind, v[kind], f"{name}.{kind}", name)


def _guided(kind: str, v, shown: str, param: str | None = None) -> StructuredOutput:
    """A `json` (schema object or its JSON text), `choice`, `regex` or `grammar` constraint
    given as the field `shown` (the error's parameter: `param`, else `shown`)."""
    param = param or shown
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise FieldError(f"'{shown}' is not valid JSON: {e}", param) from None
        if not isinstance(v, dict):
            raise FieldError(f"'{shown}' must be a JSON schema (an object or its JSON "
                             f"text), got {_kind(v)}", param, "invalid_type")
        return StructuredOutput("json_schema", _utf8(json.dumps(v, ensure_ascii=False), param))
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise FieldError(f"'{shown}' must be a non-empty array of non-empty strings",
                             param, "invalid_type")
        return StructuredOutput("choice", [_utf8(c, param) for c in v])
    if not isinstance(v, str) or not v.strip():
        raise FieldError(f"'{shown}' must be a non-empty string, got {_kind(v)}", param,
                         "invalid_type")
    return StructuredOutput(kind, _utf8(v, param))
