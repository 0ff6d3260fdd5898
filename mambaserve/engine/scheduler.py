"""Continuous batching with chunked prefill under a per-step token budget, and the step's
bookkeeping: `schedule()` builds the step's `Batch`, `update(batch, results)` applies what the
forward produced (tokens, stops, releases, snapshots handed to the prefix cache).

Each step takes every running decode (one token each), then continues partially prefilled
requests, then admits waiting requests first-come-first-served while a state slot, the KV pages
the request may ever need, and a place under `max_num_seqs` are free. A request that does not
fit waits (head-of-line: later requests do not overtake it). Prefill rows come first in the
batch, decode rows last.

KV pages are reserved for the request's whole length (prompt + max_tokens, capped at
max_model_len) on admission, so a running request never needs preemption; in hybrid models the
few attention layers make pages cheap next to the Mamba state slot every request needs anyway.
"""

from __future__ import annotations

from collections import deque

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.engine.batch import Batch, Row, RowResult
from mambaserve.engine.request import Request, Status
from mambaserve.engine.snapshot_policy import SnapshotPolicy
from mambaserve.engine.stop_checker import StopChecker


class Scheduler:
    def __init__(self, state_pool: StatePool, kv_pool: KVPool, max_num_seqs: int,
                 token_budget: int, stop_checker: StopChecker,
                 policy: SnapshotPolicy | None = None) -> None:
        self.state_pool, self.kv_pool, self.policy = state_pool, kv_pool, policy
        self.stop_checker = stop_checker
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, req: Request) -> int:
        return self.kv_pool.pages_for(req.max_total_len)

    def add(self, req: Request) -> None:
        need = self.pages_needed(req)
        if need > self.kv_pool.num_pages:
            raise ValueError(
                f"request {req.request_id} needs {need} KV pages for {req.max_total_len} tokens "
                f"but the pool has {self.kv_pool.num_pages}; raise the memory budget or lower "
                "max_tokens")
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        budget = self.token_budget
        decodes = [Row(r, len(r.all_token_ids) - 1, 1) for r in self.running if r.prefill_done]
        budget -= len(decodes)
        prefills: list[Row] = []
        for r in self.running:
            if budget <= 0:
                break
            if not r.prefill_done:
                n = min(r.prompt_len - r.num_computed, budget)
                prefills.append(Row(r, r.num_computed, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            restore_from = self._admit(req)
            if restore_from is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.prompt_len - req.num_computed, budget)
            prefills.append(Row(req, req.num_computed, n, restore_from=restore_from))
            budget -= n
        if not prefills and not decodes:
            return None
        if self.policy is not None:
            for row in prefills + decodes:
                row.snapshots = self.policy.snapshots_for(
                    row.request, row.start, row.num_tokens, is_decode=row.request.prefill_done)
        return Batch(prefills, decodes)

    def _admit(self, req: Request) -> int | None:
        """Allocate the request's slot and pages (evicting cached prefixes if needed). Returns
        the cached snapshot slot its first forward restores (-1: none), None if it must wait."""
        path, hit_len = self.policy.match(req) if self.policy else ([], 0)
        shared = self.policy.pages_shared(hit_len) if self.policy else 0
        need = self.pages_needed(req) - shared
        if self.state_pool.num_free == 0 or self.kv_pool.num_free < need:
            if self.policy is None or not self.policy.make_room(path, 1, need):
                return None
        req.state_slot = self.state_pool.allocate()
        pages = self.kv_pool.allocate(need)
        req.status = Status.RUNNING
        if self.policy is None:
            req.pages = pages
            return -1
        return self.policy.admit(req, path, hit_len, pages)

    def update(self, batch: Batch, results: list[RowResult]) -> None:
        """Apply a step's results: computed tokens, prompt logprobs, sampled tokens; snapshots
        written by the forward go to the prefix cache; finished requests give back their slot
        and pages."""
        for row, res in zip(batch.rows, results):
            req = row.request
            if self.policy is not None:
                self.policy.after_forward(req)
            req.num_computed += row.num_tokens
            if res.prompt_logprobs:
                req.prompt_logprobs.extend(res.prompt_logprobs)
            if res.token_id is None:
                continue
            req.output_token_ids.append(res.token_id)
            req.cumulative_logprob += res.logprob
            if res.top_logprobs is not None:
                req.output_logprobs.append(res.top_logprobs)
            stop = self.stop_checker.check(req)
            if stop is None and req.grammar is not None and \
                    req.grammar.advance(req.output_token_ids):
                stop = ("stop", None)  # structured output: the grammar is complete
            if stop is not None:
                self.finish(req, *stop)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and give back everything the request held."""
        req.finish_reason, req.stop_reason = reason, stop_reason
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED

    def _release(self, req: Request) -> None:
        if self.policy is not None:
            self.policy.release(req)  # hands snapshots and blocks to the tree first
        if req.state_slot >= 0:
            self.state_pool.free(req.state_slot)
            req.state_slot = -1
        if req.pages:
            self.kv_pool.release(req.pages)
            req.pages = []
