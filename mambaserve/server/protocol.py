"""Parsing and validation of OpenAI request bodies into engine requests.

Everything a client sends is checked here, with the offending parameter named, before anything
reaches the engine: a value the engine would only trip over inside a forward (a NaN
temperature, a top_k beyond int32) would fail every request in flight with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from mambaserve.engine.prompt import PromptError, validate_prompt_ids
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.engine.tokenizer import ChatTemplateError
from mambaserve.server.structured_request import FieldError, sampling_extras

MAX_N = 16  # completions per prompt
MAX_BATCH = 256  # prompts in one /v1/completions request
MAX_STOP = 16  # stop strings
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the model's template decides
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


def dumps(obj) -> str:
    """Compact JSON, non-ASCII kept; a string that cannot be UTF-8 (a client's lone surrogate
    quoted back in an error) makes it fall back to \\u escapes instead of failing."""
    try:
        s = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
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


def encode_bounded(tokenizer, text: str, max_model_len: int, param: str) -> list[int]:
    """The token ids of `text`; a text that cannot fit in `max_model_len` tokens is refused
    from a prefix (4 x max_model_len characters, then 4x longer ones) without tokenizing all
    of it. The final length check is `validate_prompt_ids`'s."""
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
    return tokenizer.encode(text)


# ---- the parsed request ----------------------------------------------------------------------
@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class ParsedRequest:
    model: str | None
    prompts: list[Prompt]
    params: SamplingParams  # what the engine gets
    n: int
    stream: bool
    include_usage: bool = False
    continuous_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # top alternatives the client asked for (None: no logprobs)
    stop: list[str] = field(default_factory=list)


def _sampling(body: dict, *, max_tokens, logprobs: int | None, vocab_size: int
              ) -> tuple[SamplingParams, int, list[str]]:
    n = get_int(body, "n", 1, lo=1, hi=MAX_N)
    temperature = get_float(body, "temperature", 1.0, lo=0.0)
    top_p = get_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k = get_int(body, "top_k", 0, lo=-1)
    if top_k >= vocab_size:
        top_k = 0  # keeps every token: same as off (and stays inside int32)
    min_p = get_float(body, "min_p", 0.0, lo=0.0, hi=1.0)
    seed = get_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1)
    min_tokens = get_int(body, "min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens", code="invalid_value")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = list(stop)
    else:
        raise _type_error("stop", "a string or an array of strings", stop)
    if len(stop) > MAX_STOP:
        raise APIError(f"'stop' takes at most {MAX_STOP} strings, got {len(stop)}", param="stop",
                       code="invalid_value")
    if any(not s for s in stop):
        raise APIError("'stop' strings must not be empty", param="stop", code="invalid_value")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)):
        raise _type_error("stop_token_ids", "an array of non-negative integers", stop_ids)
    ignore_eos = get_bool(body, "ignore_eos", False)
    include_stop = get_bool(body, "include_stop_str_in_output", False)
    skip_special = get_bool(body, "skip_special_tokens", True)
    # ---- structured output, logit_bias, penalties (issue 23): server/structured_request.py
    try:
        extras = sampling_extras(body, vocab_size)
    except FieldError as e:
        raise APIError(str(e), param=e.param, code=e.code) from None
    # ---- end of structured output, logit_bias, penalties
    try:
        params = SamplingParams(
            n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
            max_tokens=max_tokens, min_tokens=min_tokens, stop=stop or None,
            stop_token_ids=stop_ids, ignore_eos=ignore_eos,
            logprobs=logprobs,  # 0: the sampled token's logprob only
            skip_special_tokens=skip_special, include_stop_str_in_output=include_stop,
            **extras)
    except ValueError as e:
        raise APIError(str(e), code="invalid_value") from None
    return params, n, stop


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    opts = get_obj(body, "stream_options")
    include = get_bool(opts, "include_usage", False)
    continuous = get_bool(opts, "continuous_usage_stats", False)
    return include and stream, continuous and stream


def _check_prompt_ids(ids: list[int], vocab_size: int, max_model_len: int, param: str) -> None:
    """The engine's own prompt checks (same messages), as a 400 naming `param`. `ids` are ints
    (the tokenizer's, or checked by the caller): the common case is settled with C-level
    min / max instead of the engine's per-id Python loop."""
    if 0 < len(ids) < max_model_len and min(ids) >= 0 and max(ids) < vocab_size:
        return
    try:
        validate_prompt_ids(ids, vocab_size, max_model_len)
    except PromptError as e:
        raise APIError(str(e), param=param, code=e.code) from None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_completion(body: dict, tokenizer, vocab_size: int, max_model_len: int
                     ) -> ParsedRequest:
    model = get_str(body, "model")
    if "prompt" not in body:
        raise APIError("'prompt' is required", param="prompt", code="missing_required_parameter")
    raw = body["prompt"]
    if isinstance(raw, str):
        items: list = [raw]
    elif isinstance(raw, list):
        if not raw:
            raise APIError("'prompt' is an empty array", param="prompt", code="empty_prompt")
        if all(_is_int(x) for x in raw):
            items = [raw]
        elif all(isinstance(x, str) for x in raw) or all(
                isinstance(x, list) and all(_is_int(t) for t in x) for x in raw):
            items = list(raw)
        else:
            raise _type_error("prompt", "a string, an array of strings, an array of token ids "
                              "or an array of token-id arrays", raw)
    else:
        raise _type_error("prompt", "a string, an array of strings, an array of token ids or an "
                          "array of token-id arrays", raw)
    if len(items) > MAX_BATCH:
        raise APIError(f"at most {MAX_BATCH} prompts per request, got {len(items)}",
                       param="prompt", code="invalid_value")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError("this model has no tokenizer: send token ids as the prompt",
                               param="prompt")
            check_unicode(item, "prompt")
            ids = encode_bounded(tokenizer, item, max_model_len, "prompt") if item else []
            prompts.append(Prompt(item, ids))
        else:
            prompts.append(Prompt(None, list(item)))
        _check_prompt_ids(prompts[-1].token_ids, vocab_size, max_model_len, "prompt")
    if get_str(body, "suffix") is not None:
        raise APIError("'suffix' is not supported by this server", param="suffix",
                       code="unsupported_parameter")
    max_tokens = get_int(body, "max_tokens", 16, lo=1)
    logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    echo = get_bool(body, "echo", False)
    stream = get_bool(body, "stream", False)
    params, n, stop = _sampling(body, max_tokens=max_tokens, logprobs=logprobs,
                                vocab_size=vocab_size)
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise APIError("'best_of' different from 'n' is not supported", param="best_of",
                       code="unsupported_parameter")
    if n * len(prompts) > MAX_BATCH:
        raise APIError(f"n x prompts must be <= {MAX_BATCH}, got {n * len(prompts)}",
                       param="n", code="invalid_value")
    include, continuous = _stream_options(body, stream)
    get_str(body, "user")
    return ParsedRequest(model, prompts, params, n, stream, include, continuous, echo,
                         logprobs, stop)


def _message_content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None:
        if m.get("role") in ("assistant", "tool"):
            return ""
        raise APIError(f"messages[{i}].content is required", param=f"messages[{i}].content",
                       code="missing_required_parameter")
    if isinstance(c, str):
        return check_unicode(c, f"messages[{i}].content")
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content[{j}]: only text parts "
                               '({"type": "text", "text": ...}) are supported',
                               param=f"messages[{i}].content", code="invalid_value")
            parts.append(check_unicode(part["text"], f"messages[{i}].content"))
        return "".join(parts)
    raise _type_error(f"messages[{i}].content", "a string or an array of text parts", c)


def parse_chat(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> ParsedRequest:
    model = get_str(body, "model")
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", param="messages",
                       code="missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array of messages", msgs)
    if not msgs:
        raise APIError("'messages' must contain at least one message", param="messages",
                       code="empty_prompt")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                           f"{_describe(role)}", param=f"messages[{i}].role",
                           code="invalid_value")
        msg = {"role": role, "content": _message_content(m, i)}
        if isinstance(m.get("name"), str):
            msg["name"] = check_unicode(m["name"], f"messages[{i}].name")
        messages.append(msg)
    tools = body.get("tools")
    if tools:
        raise APIError("tool calling is not supported by this server", param="tools",
                       code="unsupported_parameter")
    if body.get("functions"):
        raise APIError("function calling is not supported by this server", param="functions",
                       code="unsupported_parameter")
    mct = get_int(body, "max_completion_tokens", None, lo=1)
    max_tokens = mct if mct is not None else get_int(body, "max_tokens", None, lo=1)
    want_lp = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want_lp:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                       code="invalid_value")
    logprobs = (top or 0) if want_lp else None
    stream = get_bool(body, "stream", False)
    params, n, stop = _sampling(body, max_tokens=max_tokens, logprobs=logprobs,
                                vocab_size=vocab_size)
    if tokenizer is None:
        raise APIError("this model has no tokenizer, so it cannot chat; use /v1/completions "
                       "with token ids", param="messages", code="no_chat_template")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ChatTemplateError, ValueError) as e:
        raise APIError(f"cannot apply the chat template: {e}", param="messages",
                       code="no_chat_template" if "no chat template" in str(e) else
                       "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - a tokenizer class of another kind
        raise APIError(f"the model's chat template failed on these messages: "
                       f"{type(e).__name__}: {e}", param="messages",
                       code="invalid_value") from None
    ids = encode_bounded(tokenizer, text, max_model_len, "messages")
    _check_prompt_ids(ids, vocab_size, max_model_len, "messages")
    include, continuous = _stream_options(body, stream)
    get_str(body, "user")
    return ParsedRequest(model, [Prompt(text, ids)], params, n, stream, include, continuous,
                         False, logprobs, stop)
