"""SamplingParams, shaped like vLLM's so users can switch engines without edits."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias is in [-100, 100]
PENALTY_RANGE = 2.0  # presence / frequency penalties in [-2, 2] (OpenAI's range)
# repetition penalty bounds: every value stays a normal float32 and logit * penalty finite
REPETITION_RANGE = (1e-6, 1e6)
# bad_words: each step matches the request's last tokens against its words on the host
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text (constrained decoding).

    kind: "json_object" (any JSON object; spec None), "json_schema" (spec: the schema as JSON
    text), "regex" (spec: the pattern), "choice" (spec: a list of strings, exactly one of them),
    "grammar" (spec: an EBNF grammar).
    """

    kind: str
    spec: str | list[str] | None = None

    def problem(self) -> str | None:
        """What is wrong with the kind / spec shape (None: fine). Whether a schema, pattern or
        grammar compiles is checked when the engine admits the request (mambaserve/structured)."""
        if self.kind not in STRUCTURED_KINDS:
            return f"structured_output kind must be one of {', '.join(STRUCTURED_KINDS)}, " \
                   f"got {self.kind!r}"
        spec = self.spec
        if self.kind == "json_object":
            return None if spec is None else "structured_output 'json_object' takes no spec"
        if self.kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(
                    isinstance(c, str) and c for c in spec):
                return "structured_output 'choice' spec must be a non-empty list of non-empty " \
                       "strings"
            return None
        if not isinstance(spec, str) or not spec.strip():
            what = {"json_schema": "the JSON schema as JSON text (json.dumps(schema))",
                    "regex": "the regular expression", "grammar": "the EBNF grammar"}[self.kind]
            return f"structured_output {self.kind!r} spec must be a non-empty string: {what}"
        return None

    @property
    def key(self) -> tuple:
        """Hashable identity of the constraint (the compile cache's key)."""
        spec = tuple(self.spec) if isinstance(self.spec, (list, tuple)) else self.spec
        return self.kind, spec


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's length limit
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None
    # vLLM's allowed_token_ids: sampling (greedy included) only ever picks one of these ids
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words: the generated tokens never hold one of these words' token sequences
    # (structured/bad_words.py; the engine tokenizes them, so it needs the model's tokenizer)
    bad_words: list[str] | None = None
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as the
    # context holds with room for one output token)
    truncate_prompt_tokens: int | None = None
    # logits processing (docs/server.md "Logit bias and penalties"): token id -> bias added to
    # the logit; presence / frequency penalties over the generated tokens (OpenAI);
    # repetition penalty over prompt + generated tokens (vLLM / transformers; 1 = off)
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_list: list[str] = field(init=False, default_factory=list)

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.validate()

    @property
    def needs_host_token_each_step(self) -> bool:
        """The host must know this request's last token before building its next step (a
        constrained request's token mask depends on it), so such a step cannot run ahead."""
        return self.structured_output is not None

    @property
    def uses_penalties(self) -> bool:
        """Presence, frequency or repetition penalty active (per-request token counts kept on
        the device)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """The token ids this request names (logit_bias keys, allowed_token_ids) are inside the
        model's vocabulary (`vocab_size` logits)."""
        for name, ids in (("logit_bias", self.logit_bias), ("allowed_token_ids",
                                                            self.allowed_token_ids)):
            for t in ids or ():
                if t >= vocab_size:
                    raise ValueError(f"invalid SamplingParams: {name} token id {t} is outside "
                                     f"the vocabulary (size {vocab_size})")

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < 1e6:
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            bad(f"top_k must be -1, 0 (disabled) or a positive integer below 2**31, "
                f"got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and
                                   self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= self.MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {self.MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            bad("stop strings must be non-empty strings")
        if self.stop_token_ids is not None and any(
                not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        so = self.structured_output
        if so is not None:
            if not isinstance(so, StructuredOutput):
                bad(f"structured_output must be a StructuredOutput, got {type(so).__name__}")
            if (msg := so.problem()) is not None:
                bad(msg)
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                bad(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                    f"got {ids!r}")
            if so is not None:
                bad("allowed_token_ids cannot be combined with structured_output")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            bad(f"truncate_prompt_tokens must be an integer >= 1, or -1 (the context length), "
                f"got {k!r}")
        words = self.bad_words
        if words is not None and (not isinstance(words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in words)):
            bad(f"bad_words must be a list of non-empty strings, got {words!r}")
        if words is not None and (len(words) > MAX_BAD_WORDS or
                                  any(len(w) > MAX_BAD_WORD_CHARS for w in words)):
            bad(f"bad_words takes at most {MAX_BAD_WORDS} words of at most "
                f"{MAX_BAD_WORD_CHARS} characters each")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -PENALTY_RANGE <= v <= PENALTY_RANGE:
                bad(f"{name} must be a number in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], "
                    f"got {v!r}")
        lo, hi = REPETITION_RANGE
        if not _is_number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            bad(f"repetition_penalty must be a number in [{lo:g}, {hi:g}] (1 = off), "
                f"got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad(f"logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if not _is_number(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                    bad(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                        f"{MAX_LOGIT_BIAS:g}], got {b!r} for token {t}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
