"""Parsing and validation of OpenAI request bodies into engine requests.

Everything a client sends is checked here, with the offending parameter named, before anything
reaches the engine: a value the engine would only trip over inside a forward (a NaN
temperature, a top_k beyond int32) would fail every request in flight with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mambaserve.engine.prompt import PromptError, truncated, validate_prompt_ids
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.server.chat_output import ChatOutputSpec
from mambaserve.server.chat_request import ChatConfig, ChatInputs, parse_chat_inputs, render
from mambaserve.server.fields import (  # noqa: F401 - APIError, dumps, parse_json re-exported
    APIError,
    _describe,
    _type_error,
    check_unicode,
    dumps,
    encode_bounded,
    get_bool,
    get_float,
    get_int,
    get_obj,
    get_str,
    parse_json,
)
from mambaserve.server.structured_request import FieldError, sampling_extras
from mambaserve.server.tool_choice import constraint

MAX_N = 16  # completions per prompt
MAX_BATCH = 256  # prompts in one /v1/completions request
MAX_STOP = 16  # stop strings
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS  # 20


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
    # ---- issue 23 (api-server): echo scoring, chat output parsing ----
    echo_only: bool = False  # max_tokens 0 with echo: the prompt scored, no text generated
    chat: ChatOutputSpec | None = None  # how a chat choice's text becomes its message
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N", not by their text
    token_ids_as_text: bool = False
    # vLLM's prompt_logprobs in its own shape (completions: per choice, chat: top level): the
    # top alternatives per prompt token (None: no such field)
    prompt_logprobs: int | None = None
    # vLLM's cache_salt: prefix-cache entries are shared only with requests of the same salt
    cache_salt: str | None = None
    # vLLM's priority (lower first under --scheduling-policy priority; serving.py refuses
    # anything but 0 under fcfs)
    priority: int = 0


# vLLM's sampling extensions this server does not implement and whose silent omission would
# change the result (missing logprobs, processors not run, an unconstrained answer): a request
# that sets one (not null, not empty) gets a 400 naming it. Other unknown fields are ignored.
UNSUPPORTED_SAMPLING_FIELDS = ("logits_processors", "structural_tag")


def _refuse_unsupported_sampling(body: dict) -> None:
    for name in UNSUPPORTED_SAMPLING_FIELDS:
        if body.get(name) not in (None, [], {}):
            raise APIError(f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    if body.get("use_beam_search") not in (None, False):
        raise APIError("'use_beam_search' is not supported by this server",
                       param="use_beam_search", code="unsupported_parameter")


def _sampling(body: dict, *, max_tokens, logprobs: int | None, vocab_size: int
              ) -> tuple[SamplingParams, int, list[str]]:
    _refuse_unsupported_sampling(body)
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


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs` (0-20 alternatives per prompt token). As vLLM: refused with
    `stream` unless 0 (a stream has no place for them; 0 is accepted and sends none), and -1
    (the whole vocabulary) is over the maximum."""
    if body.get("prompt_logprobs") == -1:
        raise APIError(f"'prompt_logprobs' -1 (the whole vocabulary) is more than this server's "
                       f"maximum of {MAX_LOGPROBS}", param="prompt_logprobs",
                       code="invalid_value")
    k = get_int(body, "prompt_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if stream and k:
        raise APIError("'prompt_logprobs' is not available with 'stream': true (only 0)",
                       param="prompt_logprobs", code="invalid_value")
    return None if stream else k


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    opts = get_obj(body, "stream_options")
    if opts and not stream:  # issue 23 (api-server): as OpenAI and vLLM answer
        raise APIError("'stream_options' is only allowed with 'stream': true",
                       param="stream_options", code="invalid_value")
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


def _truncation(body: dict, max_model_len: int) -> int | None:
    """vLLM's `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: as many as the
    context holds with room for one output token); None when absent."""
    k = get_int(body, "truncate_prompt_tokens", None, lo=-1)
    if k == 0:
        raise APIError("'truncate_prompt_tokens' must be >= 1, or -1 (the context length)",
                       param="truncate_prompt_tokens", code="invalid_value")
    if k is not None and k >= max_model_len:
        raise APIError(f"'truncate_prompt_tokens' must be below the model's context length "
                       f"({max_model_len} tokens, one of them for the output), got {k}",
                       param="truncate_prompt_tokens", code="invalid_value")
    return k


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: a non-empty string (None when absent or null). With prefix caching
    off it is accepted and changes nothing, as in vLLM."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise APIError(f"'cache_salt' must be a non-empty string, got {_describe(salt)}",
                       param="cache_salt",
                       code="invalid_value" if isinstance(salt, str) else "invalid_type")
    return salt


def _priority(body: dict) -> int:
    """vLLM's `priority`: an integer in int64's range (null or absent: 0)."""
    return get_int(body, "priority", 0, lo=-(2**63), hi=2**63 - 1)


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
    keep = _truncation(body, max_model_len)
    special = get_bool(body, "add_special_tokens", True)  # vLLM's default for a completion
    prompts = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise APIError("this model has no tokenizer: send token ids as the prompt",
                               param="prompt")
            check_unicode(item, "prompt")
            ids = encode_bounded(tokenizer, item, max_model_len, "prompt",
                                 keep is not None, special) if item else []
            prompts.append(Prompt(*truncated(item, ids, keep, max_model_len, tokenizer)))
        else:
            prompts.append(Prompt(*truncated(None, list(item), keep, max_model_len, tokenizer)))
        _check_prompt_ids(prompts[-1].token_ids, vocab_size, max_model_len, "prompt")
    # ---- issue 23 (api-server): suffix refused; echo scoring (max_tokens 0, prompt logprobs) --
    if get_str(body, "suffix"):
        raise APIError("'suffix' (fill-in-the-middle) is not supported by this server",
                       param="suffix", code="unsupported_parameter")
    echo = get_bool(body, "echo", False)
    max_tokens = get_int(body, "max_tokens", 16, lo=0)
    if max_tokens == 0 and not echo:
        raise APIError("'max_tokens' must be >= 1 (0 only with 'echo': true, to score the "
                       "prompt)", param="max_tokens", code="invalid_value")
    echo_only = max_tokens == 0  # vLLM's way: one token is generated and not returned
    logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    stream = get_bool(body, "stream", False)
    params, n, stop = _sampling(body, max_tokens=max_tokens or 1, logprobs=logprobs,
                                vocab_size=vocab_size)
    # the prompt's logprobs: asked for, or echoed with `logprobs` (then vLLM returns them as
    # prompt_logprobs too); the engine computes enough alternatives for both
    plp = _prompt_logprobs(body, stream)
    if echo and logprobs is not None:
        plp = logprobs if plp is None else plp
        params = dataclasses.replace(params, prompt_logprobs=max(plp, logprobs))
    elif plp is not None:
        params = dataclasses.replace(params, prompt_logprobs=plp)
    # ----
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
                         logprobs, stop, echo_only=echo_only,
                         token_ids_as_text=get_bool(body, "return_tokens_as_token_ids", False),
                         prompt_logprobs=None if stream else plp, cache_salt=_cache_salt(body),
                         priority=_priority(body))


def parse_chat(body: dict, tokenizer, vocab_size: int, max_model_len: int,
               config: ChatConfig | None = None) -> ParsedRequest:
    model = get_str(body, "model")
    # ---- issue 23 (api-server): messages, tools, template options (chat_request.py) ----
    config = config or ChatConfig()
    chat = parse_chat_inputs(body, config)
    # ----
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
    plp = _prompt_logprobs(body, stream)
    if plp is not None:
        params = dataclasses.replace(params, prompt_logprobs=plp)
    # ---- issue 23 (api-server): tool_choice "required" / named enforced (tool_choice.py) ----
    params = _with_tool_constraint(params, chat, config)
    text = render(tokenizer, chat)
    # ----
    keep = _truncation(body, max_model_len)
    # the chat template writes the special tokens itself (vLLM's default for a chat, and what
    # /tokenize of the messages counts)
    special = get_bool(body, "add_special_tokens", False)
    ids = encode_bounded(tokenizer, text, max_model_len, "messages", keep is not None, special)
    text, ids = truncated(text, ids, keep, max_model_len, tokenizer)
    _check_prompt_ids(ids, vocab_size, max_model_len, "messages")
    include, continuous = _stream_options(body, stream)
    get_str(body, "user")
    return ParsedRequest(model, [Prompt(text, ids)], params, n, stream, include, continuous,
                         False, logprobs, stop, chat=chat.output_spec(config, text),
                         token_ids_as_text=get_bool(body, "return_tokens_as_token_ids", False),
                         prompt_logprobs=plp, cache_salt=_cache_salt(body),
                         priority=_priority(body))


# ---- issue 23 (api-server) -------------------------------------------------------------------
def _with_tool_constraint(params: SamplingParams, chat: ChatInputs,
                          config: ChatConfig) -> SamplingParams:
    """`params` constrained to call a tool when tool_choice is "required" or names one."""
    so = constraint(chat.tools, config.tool_call_parser)
    if so is None:
        return params
    what = "tool_choice " + ('"required"' if chat.tools.choice == "required" else
                             f"naming {chat.tools.named!r}")
    if params.structured_output is not None:
        raise APIError(f"{what} cannot be combined with response_format or guided decoding",
                       param="tool_choice", code="invalid_value")
    try:
        return dataclasses.replace(params, structured_output=so)
    except ValueError as e:
        raise APIError(f"{what} needs constrained decoding: {e}", param="tool_choice",
                       code="unsupported_parameter") from None
