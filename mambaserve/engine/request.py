"""A request's life inside the engine: tokens, resources held, and what it has produced."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from mambaserve.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the sampler's seed (drawn by the engine when the user gave none)
    max_total_len: int  # prompt + the most tokens it may generate
    arrival: int = 0  # order of arrival: the engine numbers the sequences it is given
    # vLLM's request priority: under the "priority" scheduling policy the waiting queue is
    # ordered by (priority, arrival), lower first (engine/request_queue.py); 0 under "fcfs"
    priority: int = 0
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank
    # tokens whose effect is in the state slot / KV pages once every scheduled forward has run
    # (advanced when a row is scheduled, so the next step can be planned before this one ran)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prefix reused from the cache
    state_slot: int = -1
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    text_stream: object | None = None  # its incremental detokenizer (engine/tokenizer.TextStream)
    index: int = 0  # completion index within its parent request (n > 1)
    parent_id: str | None = None
    # its token mask: structured output's grammar matcher (structured/grammar.RequestGrammar)
    # or a fixed allowed set (structured/allowed_tokens.AllowedTokens), and bad words
    # (structured/bad_words.BadWords; several: structured/combined_mask.CombinedMask)
    grammar: object | None = None
    # prefix cache (see engine/snapshot_policy.py)
    # vLLM's cache_salt: shares cached prefixes only with requests of the same salt (None:
    # with unsalted requests only); part of the first block's key in cache/radix_cache.py
    cache_salt: str | None = None
    cache_path: list = field(default_factory=list)  # matched tree nodes, locked while running
    # snapshots handed to the tree as soon as their forward ran: position -> slot (-1 = not
    # reserved yet); the divergence point and the prompt's last block end
    tree_snapshots: dict = field(default_factory=dict)
    pending_slot: int = -1  # private slot with the state at the last interval passed
    pending_pos: int = 0  # position of the state in pending_slot (0 = none yet)
    # overlap scheduling (engine/scheduler.py): tokens sampled on the device whose values the
    # host has not read back yet, and scheduled steps holding a row of this request (its slot
    # and pages are released only when this is 0)
    inflight_tokens: int = 0
    inflight_steps: int = 0
    # preemption: the prefill of a resumed request recomputes all_token_ids[:recompute_len]
    recompute_len: int = 0
    num_preemptions: int = 0
    # the prompt as int64, converted once when the request is made: a prefill row's input ids
    # are a view of it (`Row.token_array`), not a per-step conversion of a list (~90 µs for
    # 2,048 ids on a 2-core CPU, on the host's path before a lone prompt's first kernel)
    prompt_array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = self.prompt_token_ids
        self.prompt_array = np.fromiter(ids, dtype=np.int64, count=len(ids))

    def reset_prompt_logprobs(self) -> None:
        """No prompt logprobs yet (the first token's entry is None): the prefill computes them
        (again, after a preemption before its prompt was done)."""
        self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefill_len(self) -> int:
        """Tokens the prefill covers: the prompt, or after a preemption the prompt plus the
        tokens generated before it."""
        return max(self.prompt_len, self.recompute_len)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_len

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, read back or still in flight."""
        return len(self.output_token_ids) + self.inflight_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt + every sampled token (in-flight ones included)."""
        return self.prompt_len + self.num_generated

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_host_token_each_step(self) -> bool:
        """Its next step is built only once the host has its last token: its token mask
        depends on it (structured output; bad words of several tokens)."""
        return self.params.needs_host_token_each_step or bool(
            self.grammar is not None and self.grammar.needs_host_tokens)
