"""Prompt checks shared by the Python API (`LLMEngine.validate_prompt`) and the HTTP server.

`prompt_ids` turns the engine's prompt shapes (a string, a token-id list, or a dict like vLLM's
TokensPrompt `{"prompt_token_ids": [...], "prompt": ...}` or TextPrompt `{"prompt": "..."}`) into
(text, token ids); `validate_prompt_ids` checks the ids against the model; `prompt_cache_salt`
reads a dict's "cache_salt" (vLLM's key). All raise `PromptError`, a ValueError whose `code`
names the problem in the OpenAI error vocabulary, so the server answers with the same message.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptError(ValueError):
    """A prompt the engine refuses. `code`: "empty_prompt", "context_length_exceeded" or
    "invalid_value"."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code


def prompt_ids(prompt, tokenizer) -> tuple[str | None, list]:
    """(text or None, token ids) of one prompt; strings are tokenized with `tokenizer` (None: the
    model has none). The ids are not checked here: see `validate_prompt_ids`."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            if isinstance(prompt.get("prompt"), str):  # vLLM's TextPrompt: tokenized here
                return prompt_ids(prompt["prompt"], tokenizer)
            raise PromptError("a dict prompt needs 'prompt_token_ids' (or a string 'prompt')")
        ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        if not isinstance(ids, (list, tuple)):
            raise PromptError(f"'prompt_token_ids' must be a list of token ids, got "
                              f"{type(ids).__name__}")
        return text, list(ids)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("this model has no tokenizer.json: pass prompt_token_ids")
        return prompt, (tokenizer.encode(prompt) if prompt else [])
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise PromptError(f"a prompt is a string, a list of token ids or {{'prompt_token_ids': "
                      f"[...]}}, got {type(prompt).__name__}")


def prompt_cache_salt(prompt) -> str | None:
    """The "cache_salt" of a dict prompt (vLLM's key): the prefix cache shares blocks only
    between requests of the same salt. None when absent or null, and for the other prompt
    shapes; anything but a non-empty string is refused."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        got = "an empty string" if isinstance(salt, str) else type(salt).__name__
        raise PromptError(f"'cache_salt' must be a non-empty string, got {got}")
    return salt


def truncated(text: str | None, ids: list, keep: int | None, max_model_len: int, tokenizer
              ) -> tuple[str | None, list]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max_model_len - 1,
    room for one output token; None: all of them), and their text (None without a tokenizer)
    when some were dropped."""
    if keep is None:
        return text, ids
    keep = max_model_len - 1 if keep == -1 else keep
    if len(ids) <= keep:
        return text, ids
    ids = ids[len(ids) - keep:]
    return (tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None
            else None), ids


def validate_prompt_ids(ids: Sequence, vocab_size: int, max_model_len: int) -> None:
    """Raise PromptError unless `ids` holds at least one token, leaves room for one output token
    within `max_model_len`, and every id is an int in [0, vocab_size)."""
    if len(ids) == 0:
        raise PromptError("empty prompt: it must contain at least one token", "empty_prompt")
    if len(ids) >= max_model_len:
        raise PromptError(f"prompt has {len(ids)} tokens; the model's limit (maximum context "
                          f"length) is {max_model_len} tokens including at least one output "
                          f"token", "context_length_exceeded")
    # the common case at C speed (a multi-turn history is thousands of ids, checked on every
    # turn before its first token): only ints, within the vocabulary
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return
    for t in ids:  # name the first bad id
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise PromptError(f"prompt token id {t!r} is outside the vocabulary "
                              f"[0, {vocab_size})")
