"""Tokenizer from a checkpoint folder: tokenizer.json (HF `tokenizers`) plus the special tokens
and chat template of tokenizer_config.json. transformers is not needed at run time.

Chat templates come with the checkpoint, so they are code from whoever published it: they are
rendered in jinja2's `ImmutableSandboxedEnvironment` (no access to Python internals such as
`__globals__`, no mutation of the messages, `range` capped), with the helpers Hugging Face
templates use (`raise_exception`, `strftime_now`, `tojson` with `indent`, loop controls).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    """The chat template refused the messages (`raise_exception`), is broken, or tried
    something the sandbox forbids. The message says which."""


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise ValueError(f"no tokenizer.json in {path}; pass prompt_token_ids instead of text")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception subclass
            raise ValueError(f"cannot read {file}: {e}") from e
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self._compiled: tuple[str, jinja2.Template] | None = None
        # encode_batch(_fast) releases the GIL while it tokenizes (encode does not): a long
        # prompt tokenized on a worker thread then leaves the server's event loop free
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens`: the BOS token when the checkpoint's
        tokenizer_config.json asks for it (add_bos_token)."""
        ids = self._encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def text_stream(self, skip_special_tokens: bool = True) -> TextStream:
        """An incremental decoder of one sequence of generated tokens (`TextStream`)."""
        return TextStream(self._tok, skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            continue_final_message: bool = False,
                            chat_template: str | None = None, **kwargs) -> str:
        """The chat template rendered in the sandbox, as transformers renders it: `tools` (the
        OpenAI tool definitions) and `kwargs` (chat_template_kwargs such as enable_thinking)
        are template variables. `continue_final_message`: the last message (an assistant's)
        is left open for the model to continue: the text is cut right after its content.
        `chat_template`: a template source used instead of the model's for this call (empty or
        None: the model's), in the same sandbox.
        Raises ChatTemplateError (a ValueError) when there is no template, when the template
        refuses the messages, or when it fails."""
        if chat_template:
            template = _compile_other(chat_template)
        elif not self.chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        else:
            template = self._template(self.chat_template)
        try:
            text = template.render(**kwargs, messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template attempted an operation the sandbox "
                                    f"forbids and was stopped: {e}") from None
        except Exception as e:  # noqa: BLE001 - anything a broken template raises
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") \
                from None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip():
                raise ChatTemplateError("continue_final_message needs a last message with text "
                                        "content to continue")
            cut = text.rfind(final.strip())
            if cut < 0:
                raise ChatTemplateError("continue_final_message: the chat template does not "
                                        "render the last message's content verbatim")
            text = text[:cut + len(final.strip())]
        return text

    def _template(self, source: str) -> jinja2.Template:
        if self._compiled is None or self._compiled[0] != source:
            self._compiled = (source, _compile(source))
        return self._compiled[1]


class TextStream:
    """The text of generated tokens as they arrive, one token at a time, in time independent of
    how many came before (`tokenizers`' DecodeStream: it decodes a short window of the last
    tokens and returns what the new token added). `add` returns "" while the token ends in the
    middle of a UTF-8 character (byte-fallback and byte-level tokens), and the whole character
    with the token that completes it. Re-decoding the whole output every step, as before, cost
    O(length) per token: ~280 us per request and step at 1,000 tokens on a 2-core host.

    DecodeStream raises on some byte sequences ("invalid prefix", tokenizers issue 1705 and
    vLLM's workaround for it): the stream then falls back, for this sequence only, to decoding
    all its tokens each step and returning what is new, the former behaviour."""

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tok = tok
        self._skip = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._text = ""  # returned so far

    @property
    def fell_back(self) -> bool:
        return self._stream is None

    def add(self, ids: list[int]) -> str:
        """`ids`: the sequence so far (the request's own list), its last token the new one;
        -> the text that token adds."""
        if self._stream is not None:
            try:
                new = self._stream.step(self._tok, ids[-1]) or ""
            except Exception:  # noqa: BLE001 - tokenizers raises a plain Exception
                self._stream = None
            else:
                self._text += new
                return new
        whole = self._tok.decode(ids, skip_special_tokens=self._skip).rstrip("\ufffd")
        if len(whole) <= len(self._text) or not whole.startswith(self._text):
            return ""  # nothing new that extends what was returned (never retracted)
        new, self._text = whole[len(self._text):], whole
        return new


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _raise_exception(message) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja2's own escapes <>&' for HTML pages)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_env()


def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except Exception as e:  # noqa: BLE001 - a syntax error, or a parser RecursionError
        raise ChatTemplateError(f"the chat template does not compile: "
                                f"{type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=8)
def _compile_other(source: str) -> jinja2.Template:
    """A template passed with a call (a server request's chat_template): the last few are kept
    compiled, apart from the model's own, so clients that send one do not recompile it each
    time nor evict the model's."""
    return _compile(source)
