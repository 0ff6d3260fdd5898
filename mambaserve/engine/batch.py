"""The one host description of a step: the rows the scheduler chose (each keeping a reference to
its request) and what the step produced for each row. The scheduler builds a `Batch`, the
metadata builder and the runner read it, and `Scheduler.update` applies the `RowResult`s.

Batch layout: prefill rows first (each a contiguous run of one request's new tokens), decode
rows last (one token each).

Under overlap scheduling a decode row may be scheduled before the token it feeds was read back
(the previous step is still running): `input_on_device` is then True, `token_ids` holds a
placeholder 0 for it, and the runner feeds the token from its device buffer instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mambaserve.engine.request import Request
from mambaserve.engine.sampling_params import SamplingParams


@dataclass(eq=False)
class Row:
    """One request's tokens in one forward, and where its state lives."""

    request: Request
    start: int  # first token (index into request.all_token_ids) fed in this forward
    num_tokens: int
    # prefix cache: (absolute position, destination slot) of states to snapshot in this forward.
    # Prefill rows: positions are chunk ends inside the row; decode rows: at most one, the
    # position after the row's token.
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    restore_from: int = -1  # copy this cached snapshot slot into the live slot first
    # continue from the slot's state (else start from zeros); default: start > 0
    has_initial_state: bool | None = None
    # computed once when the row is made (the request changes after the forward)
    prompt_targets: list[int] = field(init=False)  # prompt-logprob target ids, row offsets 0..q-1
    samples: bool = field(init=False)  # the row's last token yields a new sampled token
    output_index: int = field(init=False)  # index of that token among the request's outputs
    # the row's (last) token was sampled by a step whose result is not read back yet
    input_on_device: bool = field(init=False)
    applied: bool = field(init=False, default=False)  # Scheduler.update has taken its result

    def __post_init__(self) -> None:
        req = self.request
        if self.has_initial_state is None:
            self.has_initial_state = self.start > 0
        end = self.start + self.num_tokens
        self.samples = end == req.num_tokens
        self.output_index = req.num_generated
        self.input_on_device = end > len(req.output_token_ids) + req.prompt_len
        if self.input_on_device and (self.num_tokens != 1 or end != req.num_tokens):
            raise ValueError("only a one-token row may feed a token still on the device")
        self.prompt_targets = []
        # a request resumed after a preemption keeps the prompt logprobs it already has
        if req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.prompt_len:
            q = max(0, min(self.num_tokens, req.prompt_len - 1 - self.start))
            self.prompt_targets = req.prompt_token_ids[self.start + 1: self.start + 1 + q]

    @classmethod
    def standalone(cls, token_ids: list[int], context_len: int, state_slot: int,
                   has_initial_state: bool, pages: list[int],
                   snapshots: list[tuple[int, int]] | None = None,
                   restore_from: int = -1) -> Row:
        """A row over a request of its own (context_len placeholder tokens, then `token_ids`):
        for metadata built outside the engine (tests, kernel benchmarks, graph capture)."""
        req = Request("__row", None, [0] * context_len + list(token_ids), SamplingParams(), 0,
                      context_len + len(token_ids))
        req.state_slot, req.pages = state_slot, list(pages)
        return cls(req, context_len, len(token_ids), list(snapshots or []), restore_from,
                   has_initial_state)

    @property
    def token_ids(self) -> list[int]:
        """The row's input tokens; 0 stands for a token still on the device."""
        req, a, b = self.request, self.start, self.start + self.num_tokens
        p = req.prompt_len
        if a >= p:  # decode rows: no copy of the whole context every step
            ids = req.output_token_ids[a - p: b - p]
        else:
            ids = req.prompt_token_ids[a:b] + req.output_token_ids[: max(0, b - p)]
        return ids + [0] * (self.num_tokens - len(ids))

    def token_array(self) -> np.ndarray:
        """`token_ids` as int64: a view of the request's `prompt_array` for a row inside the
        prompt (every fresh prefill row), else a new array."""
        req, a, b = self.request, self.start, self.start + self.num_tokens
        if b <= req.prompt_len:
            return req.prompt_array[a:b]
        return np.fromiter(self.token_ids, dtype=np.int64, count=self.num_tokens)

    @property
    def context_len(self) -> int:
        """Tokens already in the state / KV cache before this forward."""
        return self.start

    @property
    def state_slot(self) -> int:
        return self.request.state_slot

    @property
    def pages(self) -> list[int]:
        """The request's KV pages: they cover positions [0, start + num_tokens) at least."""
        return self.request.pages

    @property
    def logits_positions(self) -> list[int]:
        """Row offsets whose logits the step needs: prompt-logprob targets, then the sample."""
        q = len(self.prompt_targets)
        return list(range(q)) + ([self.num_tokens - 1] if self.samples else [])


@dataclass
class Batch:
    prefills: list[Row]
    decodes: list[Row]

    @property
    def rows(self) -> list[Row]:
        return self.prefills + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_tokens for r in self.prefills)

    @property
    def kind(self) -> str:
        """"prefill", "mixed" or "decode"."""
        if self.prefills and self.decodes:
            return "mixed"
        return "prefill" if self.prefills else "decode"


@dataclass
class RowResult:
    """What one row's forward produced (read back from the device)."""

    token_id: int | None = None  # sampled token (rows that reach the end of their tokens)
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None  # sampled token + top-k alternatives
    prompt_logprobs: list[dict[int, float]] | None = None  # one per prompt target of the row
    prompt_ranks: list[int] | None = None  # each target's vocabulary rank (1: the likeliest)
