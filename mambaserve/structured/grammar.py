"""Structured output's host side: a `StructuredOutput` compiled once into a grammar over the
model's vocabulary (cached by kind and spec), one matcher per request advanced by each token
the request generated, and the matcher's allowed-token bitmask for the next step.

The grammar engine is xgrammar (docs/dependencies.md says why), an optional dependency: the
`structured` extra. It is imported on the first constrained request; without it that request is
refused with a ValueError naming the extra, and nothing else changes.

Kinds: "json_object" (any JSON object), "json_schema" (the schema as JSON text; properties the
schema does not list are not generated: xgrammar's strict mode), "regex", "choice" (exactly one
of the strings), "grammar" (EBNF in xgrammar's syntax, root rule `root`). JSON is generated in
one line with the separators ", " and ": " (no free whitespace: a small model given free
whitespace can pad forever). Ids past the tokenizer's vocabulary (a padded embedding) are never
allowed. When the grammar is complete only the stop tokens (the model's EOS ids) are allowed;
accepting one terminates the matcher, and the request finishes with reason "stop".
"""

from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from mambaserve.engine.sampling_params import StructuredOutput

logger = logging.getLogger("mambaserve")

EXTRA_HINT = ('structured output needs the xgrammar package, which is not installed: '
              'pip install "mambaserve[structured]"')
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")  # "[12:21:21] /project/cpp/x.cc:94: "


class _SpecError(ValueError):
    """A spec refused before xgrammar sees it (its message is already one line)."""


def import_xgrammar():
    """The xgrammar module, or a ValueError naming the extra that installs it."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(EXTRA_HINT) from None
    return xgrammar


def _one_line(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(_CPP_PREFIX.sub("", str(e).strip()).split())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


# xgrammar 0.2.9 lowers a JSON string with minLength / maxLength to repetitions of this class,
# which admits raw control characters U+0000-U+001F (invalid JSON: strict parsers refuse it);
# it is replaced by the class of xgrammar's own unbounded JSON strings (upstream: xgrammar
# issue #800). Escapes stay unavailable inside such bounded strings, as in xgrammar.
_BOUNDED_STRING_CLASS = r'[^\"\\\r\n]'
_JSON_STRING_CLASS = r'[^\0-\x1f\"\\\r\n]'


def _compile_json_schema(compiler, schema: str, strict_mode: bool):
    """JSON in one line with ", " and ": " (no free whitespace), bounded strings without raw
    control characters."""
    xgr = import_xgrammar()
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict_mode)
    text = str(grammar)
    if _BOUNDED_STRING_CLASS in text:
        grammar = xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CLASS))
    return compiler.compile_grammar(grammar)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are xgrammar's literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one model (its tokenizer, its logits width, its stop
    tokens); keeps the last `cache_size` compiled grammars by (kind, spec)."""

    def __init__(self, tokenizer_file: str | Path | None, vocab_size: int,
                 stop_token_ids: Iterable[int], cache_size: int = 256) -> None:
        self.tokenizer_file = Path(tokenizer_file) if tokenizer_file is not None else None
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._compiler = None  # xgrammar.GrammarCompiler, made on first use

    def _xgr_compiler(self):
        if self._compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer_file is None or not self.tokenizer_file.exists():
                raise ValueError("structured output needs the model's tokenizer "
                                 "(tokenizer.json), which this checkpoint does not have")
            if not self.stop_token_ids:
                raise ValueError("structured output needs the model's EOS token id, which "
                                 "neither config.json nor the tokenizer names")
            # xgrammar reads the vocabulary and its byte encoding from a transformers fast
            # tokenizer (transformers is one of xgrammar's own dependencies)
            from tokenizers import Tokenizer
            from transformers import PreTrainedTokenizerFast

            tok = Tokenizer.from_file(str(self.tokenizer_file))
            info = xgr.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids)
            # special tokens (<s>, <|im_start|>, ...) and the stop tokens are not text:
            # xgrammar never allows a token whose text is empty, and matches stop tokens by id
            vocab = [""] * self.vocab_size
            for text, i in tok.get_vocab(with_added_tokens=True).items():
                if i < self.vocab_size:
                    vocab[i] = text
            special = [i for i, added in tok.get_added_tokens_decoder().items() if added.special]
            for i in special + self.stop_token_ids:
                if i < self.vocab_size:
                    vocab[i] = ""
            info = xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=self.vocab_size,
                                     stop_token_ids=self.stop_token_ids,
                                     add_prefix_space=info.add_prefix_space)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, so: StructuredOutput):
        """The compiled grammar of `so` (cached); a ValueError with a one-line message when the
        schema, pattern or grammar is invalid or unsupported."""
        if (msg := so.problem()) is not None:
            raise ValueError(msg)
        key = so.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        compiler = self._xgr_compiler()
        try:
            compiled = self._compile(compiler, so)
        except _SpecError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
            raise ValueError(f"invalid structured output {so.kind}: {_one_line(e)}") from None
        self._cache[key] = compiled
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler, so: StructuredOutput):
        kind, spec = so.kind, so.spec
        if kind == "json_object":
            return _compile_json_schema(compiler, '{"type": "object"}', strict_mode=False)
        if kind == "json_schema":
            try:
                schema = json.loads(spec)
            except ValueError as e:
                raise _SpecError(f"invalid structured output json_schema: the schema is not "
                                 f"valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise _SpecError("invalid structured output json_schema: the schema must be a "
                                 f"JSON object, got {type(schema).__name__}")
            return _compile_json_schema(compiler, spec, strict_mode=True)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec))
        return compiler.compile_grammar(spec)  # "grammar"

    def matcher(self, so: StructuredOutput) -> RequestGrammar:
        """A fresh matcher for one request (compiles, or takes the cached grammar)."""
        return RequestGrammar(import_xgrammar().GrammarMatcher(self.compile(so)),
                              self.vocab_size, self.stop_token_ids)


class RequestGrammar:
    """One request's position in its grammar. `advance` feeds the tokens the host has read
    since the last call; `fill` writes the allowed next tokens into a bitmask row."""

    needs_host_tokens = True  # the next tokens allowed depend on the last one

    def __init__(self, matcher, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # the model's logits width: a bitmask row covers it
        self.stop_token_ids = list(stop_token_ids)
        self.num_accepted = 0  # tokens of the request's output fed so far
        self.rejected = False  # a token the grammar did not allow arrived (never expected)

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token (or refused a token): nothing more may follow."""
        return self.rejected or self._matcher.is_terminated()

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Accept `output_token_ids[num_accepted:]`; returns `finished`."""
        while self.num_accepted < len(output_token_ids) and not self.finished:
            token = output_token_ids[self.num_accepted]
            if not self._matcher.accept_token(int(token)):
                # only reachable when every allowed logit was -inf or NaN (the argmax then
                # takes a masked id): the request stops rather than continue off its grammar
                logger.error("structured output: generated token %d is not allowed by the "
                             "request's grammar; the request stops", token)
                self.rejected = True
            self.num_accepted += 1
        return self.finished

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit j of word i is
        token 32 * i + j). A finished grammar allows only the stop tokens (a step planned before
        its request's finish was seen, as overlap scheduling may do, then ends it again)."""
        if self.finished:
            words = bitmask[row].view(np.uint32)
            words[:] = 0
            for t in self.stop_token_ids:
                words[t // 32] |= np.uint32(1 << (t % 32))
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
