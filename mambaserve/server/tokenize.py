"""/tokenize and /detokenize (also under /v1/), with vLLM's request and response shapes:

    POST /tokenize {"prompt": "text", "add_special_tokens": true, "return_token_strs": false}
    POST /tokenize {"messages": [...], "add_generation_prompt": true, "tools": [...],
                    "chat_template_kwargs": {...}}          # the chat template's prompt
      (a request's own "chat_template" too, under --trust-request-chat-template, as vLLM)
      -> {"count": N, "max_model_len": L, "tokens": [ids], "token_strs": [..] | null}
    POST /detokenize {"tokens": [ids]} -> {"prompt": "text"}

The chat form renders the template exactly as /v1/chat/completions does (the same messages,
tools and template options), so its tokens are the prompt a chat request would run.
"""

from __future__ import annotations

from mambaserve.server.chat_request import ChatConfig, parse_chat_inputs, render
from mambaserve.server.fields import APIError, _type_error, check_unicode, get_bool


def _need_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise APIError("this model has no tokenizer", code="no_tokenizer")


def tokenize(body: dict, tokenizer, vocab_size: int, max_model_len: int,
             config: ChatConfig | None = None) -> dict:
    _need_tokenizer(tokenizer)
    if "messages" in body:
        text = render(tokenizer, parse_chat_inputs(body, config or ChatConfig()))
        special = get_bool(body, "add_special_tokens", False)  # the template wrote them
    elif "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str):
            raise _type_error("prompt", "a string", text)
        check_unicode(text, "prompt")
        special = get_bool(body, "add_special_tokens", True)
    else:
        raise APIError("send 'prompt' (a text) or 'messages' (a chat) to tokenize",
                       param="prompt", code="missing_required_parameter")
    ids = tokenizer.encode(text, add_special_tokens=special)
    strs = [tokenizer.token_text(t) for t in ids] \
        if get_bool(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(body: dict, tokenizer, vocab_size: int, max_model_len: int) -> dict:
    _need_tokenizer(tokenizer)
    ids = body.get("tokens")
    if ids is None:
        raise APIError("'tokens' is required", param="tokens",
                       code="missing_required_parameter")
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise _type_error("tokens", "an array of token ids", ids)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                       param="tokens", code="invalid_value")
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
