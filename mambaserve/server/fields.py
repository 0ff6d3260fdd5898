"""The request body's fields: typed access with the offending parameter named, the JSON body,
and the error every bad request is answered with (OpenAI's {"error": {...}} with an HTTP
status). Shared by the request parsers (protocol.py, chat_request.py, tokenize.py)."""

from __future__ import annotations

import json
import math

# a prompt whose first characters alone tokenize to max_model_len + this many tokens is refused
# without tokenizing the rest (the tokens of a prefix can differ from the full text's only where
# the prefix was cut, which is at a space when there is one)
PREFIX_MARGIN = 64


class APIError(Exception):
    """An error answered to the client as OpenAI's {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = \
            message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# characters Python's str.splitlines (and so httpx's SSE line reader) breaks lines at that JSON
# leaves raw: escaped, so an SSE `data:` line stays one line for every client
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj) -> str:
    """Compact JSON, non-ASCII kept (but the line separators U+0085, U+2028, U+2029 escaped); a
    string that cannot be UTF-8 (a client's lone surrogate quoted back in an error) makes it
    fall back to \\u escapes instead of failing."""
    try:
        s = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; 400 otherwise. NaN / Infinity are refused."""

    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise APIError(f"could not parse the JSON body of the request: {e}. Send a JSON object "
                       "(Content-Type: application/json).", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


# ---- typed field access ----------------------------------------------------------------------
_MISSING = object()


def _type_error(name: str, want: str, v) -> APIError:
    return APIError(f"'{name}' must be {want}, got {_describe(v)}", param=name,
                    code="invalid_type")


def _describe(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean {str(v).lower()}"
    if isinstance(v, (int, float)):
        return f"number {v!r}"
    if isinstance(v, str):
        return f"string {v[:40]!r}"
    return {"list": "an array", "dict": "an object"}.get(type(v).__name__, type(v).__name__)


def get_int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, float) and v.is_integer() and math.isfinite(v):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if lo is not None and v < lo:
        raise APIError(f"'{name}' must be >= {lo}, got {v}", param=name, code="invalid_value")
    if hi is not None and v > hi:
        raise APIError(f"'{name}' must be <= {hi}, got {v}", param=name, code="invalid_value")
    return v


def get_float(body: dict, name: str, default=None, lo: float | None = None,
              hi: float | None = None, lo_open: bool = False):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    v = float(v)
    if not math.isfinite(v):
        raise APIError(f"'{name}' must be a finite number, got {v}", param=name,
                       code="invalid_value")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        op = ">" if lo_open else ">="
        raise APIError(f"'{name}' must be {op} {lo:g}, got {v:g}", param=name,
                       code="invalid_value")
    if hi is not None and v > hi:
        raise APIError(f"'{name}' must be <= {hi:g}, got {v:g}", param=name, code="invalid_value")
    return v


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def get_str(body: dict, name: str, default=None):
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


def get_obj(body: dict, name: str) -> dict:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return {}
    if not isinstance(v, dict):
        raise _type_error(name, "an object", v)
    return v


# a prompt that truncate_prompt_tokens cuts is tokenized whole up to this many characters per
# token of the context (a bound on the tokenizer's work for one request)
TRUNCATE_CHARS_PER_TOKEN = 32


def check_unicode(s: str, param: str) -> str:
    """`s` unless it holds a lone surrogate (JSON's "\\ud800" escapes decode to one): such a
    string is not Unicode text, no tokenizer takes it, and it cannot be encoded as UTF-8."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{param}' is not valid Unicode: it holds a lone surrogate "
                       f"{s[e.start]!r} at character {e.start}", param=param,
                       code="invalid_value") from None
    return s


def encode_bounded(tokenizer, text: str, max_model_len: int, param: str,
                   truncating: bool = False, add_special_tokens: bool = True) -> list[int]:
    """The token ids of `text` (`add_special_tokens`: the tokenizer's BOS when its config asks
    for one); a text that cannot fit in `max_model_len` tokens is refused from a prefix (4 x
    max_model_len characters, then 4x longer ones) without tokenizing all of it. The final
    length check is `validate_prompt_ids`'s. `truncating` (the request keeps only the prompt's
    last tokens): any length is tokenized up to TRUNCATE_CHARS_PER_TOKEN x max_model_len
    characters; a longer text is refused."""
    if truncating:
        cap = TRUNCATE_CHARS_PER_TOKEN * max(max_model_len, 1024)
        if len(text) > cap:
            raise APIError(f"prompt of {len(text)} characters is too long to truncate: at most "
                           f"{cap} characters are tokenized", param=param,
                           code="context_length_exceeded")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    k = 4 * max(max_model_len, 1024)
    while k < len(text):
        cut = text.rfind(" ", k // 2, k)
        cut = cut if cut > 0 else k
        n = len(tokenizer.encode(text[:cut]))
        if n >= max_model_len + PREFIX_MARGIN:
            raise APIError(f"prompt is longer than the model's limit (maximum context length) of "
                           f"{max_model_len} tokens: its first {cut} of {len(text)} characters "
                           f"alone are {n} tokens", param=param,
                           code="context_length_exceeded")
        k *= 4
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
