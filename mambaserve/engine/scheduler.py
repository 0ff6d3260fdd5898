"""Continuous batching with chunked prefill under a per-step token budget, KV pages on demand
with preemption, and the step's bookkeeping: `schedule()` builds the step's `Batch`,
`update(batch, results)` applies what the forward produced (tokens, stops, releases, snapshots
handed to the prefix cache). See docs/architecture.md ("The step loop").

Each step walks the running requests oldest first: a decode (one token) for each request whose
prefill is done, the next chunk for each partially prefilled one, then admits waiting requests
in the waiting queue's order while a state slot, the KV pages of their first chunk and a place
under `max_num_seqs` are free (head-of-line: a request that does not fit makes later ones wait).
The order is the scheduling policy's (`EngineConfig.scheduling_policy`, engine/request_queue.py):
"fcfs" first come first served, "priority" by (priority, arrival), lower first. While
decodes run, the step's prefill tokens are capped at `max_step_prefill_tokens` so a burst of
arrivals does not stall every stream for a whole chunk; when the prompt tokens still to prefill
(waiting and partly prefilled requests) are no more than that cap, the tighter
`steady_step_prefill_tokens` applies instead (steady arrivals: small slices that keep every
stream's inter-token latency near a decode step, e.g. slices a prefill CUDA graph replays).
Prefill rows come first in the batch, decode rows last.

KV pages on demand: a request holds the pages of the positions it has written plus those its next
row writes. When a running request needs a page and none is free (after evicting cached
prefixes), a running request is preempted: under "fcfs" the most recently admitted one, under
"priority" the one with the largest (priority, arrival), which may be one already given a row of
this step (that row is dropped). Its slot and pages go back (its latest snapshot and blocks to
the prefix cache), it returns to the waiting queue (under "fcfs" to the front, under "priority"
to the place of its key), and on re-admission it recomputes its prompt and the tokens it had
generated (`Request.recompute_len`) before sampling on; the sampler's noise depends on (seed,
token index), so the continuation is the one it would have produced. A waiting request never
preempts a running one, whatever its priority: it waits for memory as under "fcfs" (vLLM's
rule).

Overlap scheduling: a step may be scheduled while the previous one still runs. `schedule()`
therefore advances `num_computed` and counts the sampled token as in flight (`inflight_tokens`)
when it makes a row, and a request that finishes (or is aborted) while a step holding one of its
rows is in flight keeps its slot and pages until that step's results were applied (the rows it
left are computed and their tokens discarded). Preempting a request with a row in flight would
free memory a running step still writes: `schedule()` returns `DRAIN` instead, and the engine
completes the step in flight and schedules again.
"""

from __future__ import annotations

from mambaserve.cache.kv_pool import KVPool
from mambaserve.cache.state_pool import StatePool
from mambaserve.engine.batch import Batch, Row, RowResult
from mambaserve.engine.request import Request, Status
from mambaserve.engine.request_queue import priority_key, waiting_queue
from mambaserve.engine.snapshot_policy import SnapshotPolicy
from mambaserve.engine.stop_checker import StopChecker

DRAIN = "drain"  # schedule(): complete the step in flight first, then schedule again


class Scheduler:
    def __init__(self, state_pool: StatePool, kv_pool: KVPool, max_num_seqs: int,
                 token_budget: int, stop_checker: StopChecker,
                 policy: SnapshotPolicy | None = None,
                 max_step_prefill_tokens: int | None = None,
                 steady_step_prefill_tokens: int | None = None,
                 scheduling_policy: str = "fcfs") -> None:
        self.state_pool, self.kv_pool, self.policy = state_pool, kv_pool, policy
        self.stop_checker = stop_checker
        self.max_num_seqs, self.token_budget = max_num_seqs, token_budget
        self.max_step_prefill_tokens = max_step_prefill_tokens or token_budget
        self.steady_step_prefill_tokens = min(
            steady_step_prefill_tokens or self.max_step_prefill_tokens,
            self.max_step_prefill_tokens)
        self.scheduling_policy = scheduling_policy
        self.waiting = waiting_queue(scheduling_policy)  # request_queue.py: add, requeue, ...
        self.running: list[Request] = []  # in admission order
        # finished or aborted while a step holding one of their rows is in flight
        self.releasing: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        need = self.kv_pool.pages_for(req.max_total_len)
        if need > self.kv_pool.num_pages:
            raise ValueError(
                f"request {req.request_id} needs {need} KV pages for {req.max_total_len} tokens "
                f"but the pool has {self.kv_pool.num_pages}; raise the memory budget or lower "
                "max_tokens")
        req.status = Status.WAITING
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.releasing)

    def needs_host_tokens(self) -> bool:
        """A running request that must see its last token before its next step is built has a
        token in flight (constrained decoding): the next step must not run ahead."""
        return any(r.inflight_tokens and r.needs_host_token_each_step for r in self.running)

    def prefill_backlog(self) -> int:
        """Prompt tokens still to prefill: the waiting requests' and the partly prefilled ones'
        (a prefix-cache hit will skip some of them)."""
        return (sum(r.prefill_len - r.num_computed for r in self.waiting)
                + sum(r.prefill_len - r.num_computed for r in self.running if not r.prefill_done))

    def _prefill_cap(self) -> int:
        """The prefill tokens a step may take while decodes run (module docstring)."""
        cap = self.max_step_prefill_tokens
        if self.steady_step_prefill_tokens < cap and self.prefill_backlog() <= cap:
            return self.steady_step_prefill_tokens
        return cap

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> Batch | str | None:
        """The next step's batch; None when there is nothing to run; `DRAIN` when a request
        with a row in flight would have to be preempted (nothing was scheduled then)."""
        # pass 1: what each running request runs next, and its pages (preempting if needed)
        decoding = sum(1 for r in self.running if r.prefill_done and r.num_tokens < r.max_total_len)
        budget = self.token_budget - decoding
        if decoding:
            budget = min(budget, self._prefill_cap())
        # (request, start, tokens, restore_from, prefill tokens taken from the budget)
        plan: list[tuple[Request, int, int, int, int]] = []
        preempted = False
        for r in list(self.running):  # a copy: a preemption removes requests from the list
            if r.status is not Status.RUNNING:  # preempted earlier in this walk
                continue
            if r.prefill_done:
                if r.num_tokens >= r.max_total_len:  # its last token is in flight
                    continue
                start, n = r.num_tokens - 1, 1
            else:
                start, n = r.num_computed, min(r.prefill_len - r.num_computed, budget)
                if n <= 0:
                    continue
            got = self._grow(r, start + n)
            if got == DRAIN:
                return DRAIN
            if got is not True:
                preempted = True
                if self.scheduling_policy != "fcfs":  # a victim may have a row planned above
                    budget += sum(p[4] for p in plan if p[0].status is not Status.RUNNING)
                    plan = [p for p in plan if p[0].status is Status.RUNNING]
            if got is False:  # r itself was preempted
                continue
            taken = 0 if r.prefill_done else n
            plan.append((r, start, n, -1, taken))
            budget -= taken
        # admissions (not in a step that had to preempt: the memory is needed by those running)
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            admitted = self._admit(req, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            n, restore_from = admitted
            plan.append((req, req.num_computed, n, restore_from, n))
            budget -= n
        if not plan:
            return None
        # pass 2: the rows; from here on the step counts as scheduled
        prefills: list[Row] = []
        decodes: list[Row] = []
        for req, start, n, restore_from, _ in plan:
            is_decode = req.prefill_done
            row = Row(req, start, n, restore_from=restore_from)
            if self.policy is not None:
                row.snapshots = self.policy.snapshots_for(req, start, n, is_decode=is_decode)
            (decodes if is_decode else prefills).append(row)
            req.num_computed = start + n
            req.inflight_steps += 1
            req.inflight_tokens += row.samples
        return Batch(prefills, decodes)

    def _grow(self, req: Request, num_tokens: int) -> bool | str | None:
        """Give `req` the KV pages of positions [0, num_tokens). True: done; False: `req` itself
        was preempted; None: done after preempting other requests (`_victim`); DRAIN: the
        request to preempt has a row in flight, or finished requests still hold pages until the
        step in flight is collected."""
        preempted = False
        while True:
            need = self.kv_pool.pages_for(num_tokens) - len(req.pages)
            if need <= 0:
                return None if preempted else True
            if self.kv_pool.num_free < need and self.policy is not None:
                self.policy.make_room([], 0, need)
            if self.kv_pool.num_free >= need:
                req.pages += self.kv_pool.allocate(need)
                continue
            victim = self._victim()
            if victim.inflight_steps or self.releasing:  # collecting may free what is needed
                return DRAIN
            if victim is req and len(self.running) == 1:
                # cannot happen: add() refuses a request longer than the whole pool
                raise RuntimeError(f"request {req.request_id} alone does not fit the KV pool")
            self.preempt(victim)
            preempted = True
            if victim is req:
                return False

    def _victim(self) -> Request:
        """The running request to preempt when pages run out: the most recently admitted
        ("fcfs"), or the one with the largest (priority, arrival) ("priority", vLLM's choice)."""
        if self.scheduling_policy == "fcfs":
            return self.running[-1]
        return max(self.running, key=priority_key)

    def preempt(self, req: Request) -> None:
        """Free a running request's slot and pages and requeue it (under "fcfs" at the front of
        the waiting queue, under "priority" at its key's place); it recomputes its tokens when
        admitted again. Needs no row of it in flight."""
        assert not req.inflight_steps and not req.inflight_tokens, "preempting a request in flight"
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.recompute_len = len(req.all_token_ids)
        if req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < req.prompt_len:
            req.reset_prompt_logprobs()  # recomputed with the prompt
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.requeue(req)
        self.num_preemptions += 1

    def _admit(self, req: Request, budget: int) -> tuple[int, int] | None:
        """Allocate the request's slot and the pages of its first chunk (evicting cached prefixes
        if needed). Returns (tokens of the first chunk, cached snapshot slot its first forward
        restores or -1), None if it must wait."""
        path, hit_len = self.policy.match(req) if self.policy else ([], 0)
        n = min(req.prefill_len - hit_len, budget)
        shared = self.policy.pages_shared(hit_len) if self.policy else 0
        need = self.kv_pool.pages_for(hit_len + n) - shared
        short = self.state_pool.num_free == 0 or self.kv_pool.num_free < need
        if short and (self.policy is None or not self.policy.make_room(path, 1, need)):
            return None
        req.state_slot = self.state_pool.allocate()
        pages = self.kv_pool.allocate(need)
        req.status = Status.RUNNING
        if self.policy is None:
            req.pages = pages
            return n, -1
        return n, self.policy.admit(req, path, hit_len, pages)

    # ---- update ------------------------------------------------------------------------------
    def update(self, batch: Batch, results: list[RowResult]) -> list[Request]:
        """Apply a step's results: prompt logprobs, sampled tokens, stops; snapshots written by
        the forward go to the prefix cache; finished requests give back their slot and pages
        (once no step holding a row of theirs is in flight). The token of a request that had
        already finished is discarded. Returns the requests whose output changed."""
        changed = []
        for row, res in zip(batch.rows, results):
            req = row.request
            self._settle(row)
            if self.policy is not None:
                self.policy.after_forward(req, row)
            if req.finished:
                self._release_if_idle(req)
                continue
            changed.append(req)
            if res.prompt_logprobs:
                req.prompt_logprobs.extend(res.prompt_logprobs)
                req.prompt_ranks.extend(res.prompt_ranks)
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
        return changed

    def abandon(self, batch: Batch) -> None:
        """A scheduled step failed (it raised before its results were applied): its rows no
        longer count as in flight, so finished or aborted requests can be released. The
        requests still running are left for the caller to abort (the server fails them)."""
        for row in batch.rows:
            if not row.applied:
                self._settle(row)
                self._release_if_idle(row.request)

    @staticmethod
    def _settle(row: Row) -> None:
        row.applied = True
        row.request.inflight_steps -= 1
        row.request.inflight_tokens -= row.samples

    def _release_if_idle(self, req: Request) -> None:
        if req.finished and not req.inflight_steps and req in self.releasing:
            self.releasing.remove(req)
            self._release(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark finished and give back everything the request held (after its rows in flight).
        Unless a stop string ended it (then its text is already cut there), its text becomes the
        whole output decoded once (`StopChecker.final_text`)."""
        req.finish_reason, req.stop_reason = reason, stop_reason
        if not isinstance(stop_reason, str):
            self.stop_checker.final_text(req)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        if req.inflight_steps:
            self.releasing.append(req)
        else:
            self._release(req)

    def _release(self, req: Request) -> None:
        if self.policy is not None:
            self.policy.release(req)  # hands snapshots and blocks to the tree first
        if req.state_slot >= 0:
            self.state_pool.free(req.state_slot)
            req.state_slot = -1
        if req.pages:
            self.kv_pool.release(req.pages)
            req.pages = []
