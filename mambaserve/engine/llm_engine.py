"""LLMEngine: owns the model, the pools, the scheduler and the runner, and orchestrates a step:
`scheduler.schedule()` -> `runner.launch(batch)` -> `runner.collect` + `scheduler.update(batch,
results)`; returns the outputs that changed. The bookkeeping itself lives in the scheduler.

With overlap scheduling (`EngineConfig.async_scheduling`), a step launches step N+1 before it
collects step N, so the host plans and queues the next forward while the device runs the current
one; without it, the same code collects each step right after launching it. See
docs/architecture.md ("The step loop")."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import weakref
from pathlib import Path

import torch

from mambaserve.cache.radix_cache import PrefixCache
from mambaserve.config import EngineConfig, ModelConfig, resolve_device
from mambaserve.engine.batch import Batch
from mambaserve.engine.outputs import CompletionOutput, RequestOutput
from mambaserve.engine.prompt import prompt_cache_salt, prompt_ids, truncated, validate_prompt_ids
from mambaserve.engine.rank_setup import build_rank
from mambaserve.engine.request import Request, Status
from mambaserve.engine.request_queue import check_priority
from mambaserve.engine.runner import StepHandle
from mambaserve.engine.sampling_params import SamplingParams
from mambaserve.engine.scheduler import DRAIN, Scheduler
from mambaserve.engine.snapshot_policy import SnapshotPolicy
from mambaserve.engine.stop_checker import StopChecker
from mambaserve.engine.tokenizer import Tokenizer
from mambaserve.structured.allowed_tokens import AllowedTokens
from mambaserve.structured.bad_words import BadWords, bad_word_sequences
from mambaserve.structured.combined_mask import CombinedMask
from mambaserve.structured.grammar import GrammarCompiler

logger = logging.getLogger("mambaserve")


class LLMEngine:
    def __init__(self, model_path: str | Path, config: EngineConfig, *,
                 _tp_fault: tuple[int, int, str] | None = None) -> None:
        """`_tp_fault` is a test hook: (rank, step, "raise" | "exit") makes that tensor-parallel
        worker fail when it receives its step-th step (distributed/worker.py)."""
        config.validate()
        self.config = config
        path = Path(model_path)
        self.model_config = ModelConfig.from_hf(path)
        self.device = torch.device(resolve_device(config.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.snapshot_interval = self._snapshot_interval()
        # tensor parallelism: ranks 1..N-1 run in worker processes (distributed/launcher.py)
        self.tp_workers = None
        if config.tensor_parallel_size > 1:
            from mambaserve.distributed.launcher import TPWorkers

            self.tp_workers, self.device = TPWorkers.start(
                path, dataclasses.replace(config, device=str(self.device)), _tp_fault)
        try:
            rank = build_rank(path, config, self.model_config, self.device, self.max_model_len,
                              self.tp_workers.tp if self.tp_workers else None,
                              self.tp_workers.ctx.agree if self.tp_workers else None)
        except BaseException as e:
            if self.tp_workers is not None:  # stop the workers, whatever they are doing
                # rank 0's own ValueError (a shape that does not shard, a budget too small) is
                # the clear one: the workers met the same
                failure = None if isinstance(e, ValueError) else self._tp_failure(e, wait_s=2.0)
                self.tp_workers.close(timeout_s=0.0)
                if failure is not None:
                    raise failure from e
            raise
        self.rank = rank
        self.model, self.state_pool, self.kv_pool = rank.model, rank.state_pool, rank.kv_pool
        self.runner = rank.runner
        self.dtype, self.ssm_dtype = rank.dtype, rank.ssm_dtype
        self.weight_bytes, self.expert_weight_bytes = rank.weight_bytes, rank.expert_weight_bytes
        if self.tp_workers is not None:
            self.runner.send_step = self.tp_workers.send_step
            weakref.finalize(self, self.tp_workers.close)  # collected or at exit: stop them
        self.tokenizer = Tokenizer(path) if (path / "tokenizer.json").exists() else None
        self.prefix_cache = PrefixCache(self.snapshot_interval, self.state_pool, self.kv_pool) \
            if config.enable_prefix_caching else None
        self.scheduler = Scheduler(
            self.state_pool, self.kv_pool, config.max_num_seqs, config.chunked_prefill_size,
            StopChecker(self.tokenizer, set(self.model_config.eos_token_ids)),
            SnapshotPolicy(self.prefix_cache) if self.prefix_cache else None,
            config.max_step_prefill_tokens, self._steady_prefill_cap(),
            config.scheduling_policy)
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self._inflight: StepHandle | None = None  # the step launched and not collected yet
        self._scheduled: list[Batch] = []  # scheduled steps whose results are not applied yet
        # structured output: compiles on first use (xgrammar imported then)
        self.grammars = GrammarCompiler(
            path / "tokenizer.json" if self.tokenizer is not None else None,
            self.model_config.vocab_size, self.scheduler.stop_checker.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._parents: dict[str, list[Request]] = {}
        self._rng = random.Random(config.seed)
        self._counter = itertools.count()
        self.stats = {"steps": 0, "prefill_rows": 0, "decode_rows": 0, "mixed_steps": 0,
                      "chunked_prefills": 0, "preemptions": 0, "device_busy_seconds": 0.0}
        # what the last step() ran: (kind "prefill" | "mixed" | "decode", prefill tokens,
        # decode rows), None when it had nothing to run (the server's step-time metric)
        self.last_step: tuple[str, int, int] | None = None
        if self.device.type == "cuda":
            self.warmup()

    def warmup(self) -> None:
        """A prefill-only, a mixed and a decode step on throwaway prompts, so the Triton kernels
        of every eager forward kind are compiled before the first request (CUDA graphs are
        captured before, which compiles theirs): on the H200 a fresh
        server's first requests otherwise waited ~12 s for JIT compiles (docs/benchmarks.md).
        The prefix cache sees none of it (no policy during the warm-up); the stats, the seed
        generator and the arrival counter start afresh, so later requests are unaffected."""
        policy, self.scheduler.policy = self.scheduler.policy, None
        p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        # prompts past the prefill graphs' largest bucket, so both steps run eagerly (the
        # graphs' kernels were compiled when they were captured)
        graphs = self.runner.prefill_graph_runner
        longest_graph = graphs.solo_buckets[-1] if graphs is not None else 0
        n = max(1, min(max(self.model_config.chunk_size + 3, longest_graph + 2),
                       self.max_model_len - 4, self.config.chunked_prefill_size))
        try:
            self.add_request("__warmup_prefill", {"prompt_token_ids": [0] * n}, p)
            self.step()  # prefill only
            self.add_request("__warmup_mixed", {"prompt_token_ids": [0] * max(1, n // 2)}, p)
            while self.has_unfinished_requests():  # mixed, then decode-only steps
                self.step()
        finally:
            self.scheduler.policy = policy
        self.stats = dict.fromkeys(self.stats, 0)
        self.stats["device_busy_seconds"] = 0.0
        self.scheduler.num_preemptions, self.runner.busy_seconds = 0, 0.0
        self._rng = random.Random(self.config.seed)
        self._counter = itertools.count()

    def _steady_prefill_cap(self) -> int | None:
        """The scheduler's steady-arrival prefill cap: as configured, else the largest prefill
        graph bucket when those graphs are captured (a slice that replays a graph)."""
        if self.config.steady_step_prefill_tokens is not None:
            return self.config.steady_step_prefill_tokens
        graphs = self.runner.prefill_graph_runner
        return graphs.token_buckets[-1] if graphs is not None else None

    def _snapshot_interval(self) -> int:
        """Default: the smallest legal interval, lcm(chunk_size, page_size). The number of
        snapshots is set by the policy (one per request in flight, one per cached branch end or
        divergence point), not by the interval, so the finest interval reuses the most at no
        extra memory; its cost is one state copy per interval crossed while decoding."""
        chunk, page = self.model_config.chunk_size, self.config.page_size
        interval = self.config.mamba_snapshot_interval
        if interval is None:
            return math.lcm(chunk, page)
        if interval <= 0 or interval % chunk:
            raise ValueError(f"mamba_snapshot_interval={interval} must be a positive multiple of "
                             f"the model's SSD chunk size ({chunk})")
        if interval % page:
            raise ValueError(f"mamba_snapshot_interval={interval} must be a multiple of the KV "
                             f"page size ({page})")
        return interval

    # ---- memory ----------------------------------------------------------------------------
    def memory_report(self) -> dict:
        """This rank's weights and pools (rank 0 under tensor parallelism); with N > 1 ranks
        also `tensor_parallel_size` and `ranks`, every rank's report in rank order."""
        own = self.rank.memory_report()
        report = {k: v for k, v in own.items() if k not in ("device", "tp_rank")}
        if self.tp_workers is not None:
            report["tensor_parallel_size"] = self.config.tensor_parallel_size
            report["ranks"] = self.call_ranks("memory_report", own)
        return report

    # ---- tensor parallelism -----------------------------------------------------------------
    def call_ranks(self, name: str, own, *args) -> list:
        """Ask every rank (worker.Follower.call_<name>); their answers in rank order."""
        try:
            return self.tp_workers.call(name, own, *args)
        except BaseException as e:
            failure = self._tp_failure(e)
            if failure is not None:
                raise failure from e
            raise

    def _tp_failure(self, error: BaseException, wait_s: float = 5.0) -> BaseException | None:
        """After `error`: when a tensor-parallel rank died, the TPWorkerError naming it (the
        workers are closed: the engine cannot continue); else None."""
        workers = self.tp_workers
        if workers is None or isinstance(error, (KeyboardInterrupt, SystemExit)):
            return None
        reason = workers.failure(wait_s=wait_s)
        if reason is None:
            return None
        workers.close(timeout_s=2.0)
        from mambaserve.distributed.launcher import TPWorkerError

        return error if isinstance(error, TPWorkerError) else TPWorkerError(reason)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at one rank). Idempotent; the engine
        runs no step after it."""
        if self.tp_workers is not None:
            self.tp_workers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests --------------------------------------------------------------------------
    def _bad_word_sequences(self, params: SamplingParams) -> list[list[int]]:
        """The token sequences of the request's bad words (structured/bad_words.py)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer (no tokenizer.json in the "
                             "checkpoint)")
        seqs = bad_word_sequences(self.tokenizer, params.bad_words)
        vocab = self.model_config.vocab_size
        for seq in seqs:
            if max(seq) >= vocab:
                raise ValueError(f"bad_words token id {max(seq)} is outside the vocabulary "
                                 f"(size {vocab})")
        return seqs

    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | None = None, priority: int = 0) -> None:
        """Queue a request (its `params.n` completions). `priority`: vLLM's, an integer, lower
        served first under `scheduling_policy="priority"`; anything but 0 is refused under
        "fcfs" (request_queue.check_priority). A refused request queues nothing."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params)}")
        check_priority(priority, self.config.scheduling_policy)
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        params.validate()
        text, ids = self.validate_prompt(prompt, params.truncate_prompt_tokens)
        salt = prompt_cache_salt(prompt)  # a dict's "cache_salt"; its n completions share it
        params.check_vocab(self.model_config.vocab_size)
        so = params.structured_output
        if so is not None:
            self.grammars.compile(so)  # a bad schema / pattern / grammar: ValueError, nothing queued
        vocab = self.model_config.vocab_size
        bad_words = self._bad_word_sequences(params)
        limit = self.max_model_len
        if params.max_tokens is None:  # up to the length limit, or what the KV pool can hold
            limit = min(limit, self.kv_pool.num_pages * self.kv_pool.page_size)
        room = max(1, limit - len(ids))
        max_total = len(ids) + min(params.max_tokens or room, room)
        children = []
        for i in range(params.n):
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(62)
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            req = Request(rid, text, list(ids), params, seed, max_total,
                          arrival=next(self._counter), priority=priority, index=i,
                          parent_id=request_id, cache_salt=salt)
            if params.prompt_logprobs is not None:
                req.reset_prompt_logprobs()
            masks = [self.grammars.matcher(so)] if so is not None else []
            if params.allowed_token_ids is not None:  # a fixed token mask on the same path
                masks.append(AllowedTokens(params.allowed_token_ids, vocab))
            if bad_words:
                masks.append(BadWords(bad_words, vocab))
            req.grammar = masks[0] if len(masks) == 1 else CombinedMask(masks) if masks else None
            children.append(req)
        for req in children:
            self.scheduler.add(req)
        for req in children:
            self.requests[req.request_id] = req
        self._parents[request_id] = children

    def validate_prompt(self, prompt: str | dict | list[int], truncate: int | None = None
                        ) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt this engine accepts, its last `truncate`
        tokens when that is set (`SamplingParams.truncate_prompt_tokens`); a PromptError (a
        ValueError) names what is wrong otherwise. Queues nothing."""
        text, ids = prompt_ids(prompt, self.tokenizer)
        text, ids = truncated(text, ids, truncate, self.max_model_len, self.tokenizer)
        validate_prompt_ids(ids, self.model_config.vocab_size, self.max_model_len)
        return text, ids

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its completions); frees its slot and pages. False if unknown."""
        return self.abort_with_output(request_id) is not None

    def abort_with_output(self, request_id: str) -> RequestOutput | None:
        """Abort a request and return its last output (finished; the completions still running
        end with finish_reason "abort" and their whole text decoded). None if unknown."""
        children = self._parents.get(request_id)
        if not children:
            return None
        for req in children:
            if not req.finished:
                self.scheduler.finish(req, "abort")
        return self.output_of(request_id)  # every child finished: forgets the request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    @property
    def num_running(self) -> int:
        """Sequences admitted to the running batch (every completion of an n > 1 request)."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission."""
        return len(self.scheduler.waiting)

    def sequences_of(self, request_id: str) -> int:
        """How many sequences the request holds in the engine (its n); 0 once its final output
        was returned, or if the id is unknown."""
        return len(self._parents.get(request_id, ()))

    def unfinished_request_ids(self) -> list[str]:
        """Ids given to `add_request` whose final output has not been returned yet."""
        return list(self._parents)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then collect the step before it (overlap) or this
        one (no overlap); returns the outputs the collected step changed. A step that cannot
        run ahead (a request needs its last token on the host, or a request with a row in
        flight must be preempted) first collects the step in flight."""
        if self.tp_workers is not None and self.tp_workers.closed:
            why = (self.tp_workers.failed or "close()").splitlines()[0]
            raise RuntimeError(f"the engine was closed (tensor-parallel workers stopped: {why})")
        try:
            done = self._step()
        except BaseException as e:
            # nothing of a step that raised is in flight any more: forget its rows
            for batch in self._scheduled:
                self.scheduler.abandon(batch)
            self._scheduled, self._inflight = [], None
            if self.tp_workers is not None:
                failure = self._tp_failure(e)
                # a step that raised may have left the ranks out of step: the engine stops
                self.tp_workers.close(timeout_s=2.0)
                if failure is not None and failure is not e:
                    raise failure from e
            raise
        touched: dict[str, None] = {}
        for changed in done:
            touched.update(dict.fromkeys(r.parent_id for r in changed))
        return [self.output_of(pid) for pid in touched if pid in self._parents]

    def _step(self) -> list[list[Request]]:
        done: list[list[Request]] = []
        if self._inflight is not None and self.scheduler.needs_host_tokens():
            done.append(self._collect())
        batch = self.scheduler.schedule()
        if batch == DRAIN:
            if self._inflight is None:
                raise RuntimeError("the scheduler waits for a step in flight, but none is")
            done.append(self._collect())
            batch = self.scheduler.schedule()
            assert batch != DRAIN, "nothing is in flight after a drain"
        handle = None
        if batch is not None:
            self._scheduled.append(batch)
            handle = self.runner.launch(batch)
            self._record_stats(batch)
        else:
            self.last_step = None
        if self._inflight is not None:
            done.append(self._collect())
        self._inflight = handle
        if handle is not None and not self.async_scheduling:
            done.append(self._collect())
        return done

    def _collect(self) -> list[Request]:
        """Wait for the step in flight and apply its results; returns the requests it changed."""
        handle, self._inflight = self._inflight, None
        results = self.runner.collect(handle)
        changed = self.scheduler.update(handle.batch, results)
        self._scheduled = [b for b in self._scheduled if b is not handle.batch]
        self.stats["preemptions"] = self.scheduler.num_preemptions
        self.stats["device_busy_seconds"] = self.runner.busy_seconds
        return changed

    def _record_stats(self, batch: Batch) -> None:
        self.last_step = (batch.kind, batch.num_prefill_tokens, len(batch.decodes))
        s = self.stats
        s["steps"] += 1
        s["prefill_rows"] += len(batch.prefills)
        s["decode_rows"] += len(batch.decodes)
        s["mixed_steps"] += batch.kind == "mixed"
        s["chunked_prefills"] += sum(
            1 for r in batch.prefills if r.start > 0 or r.start + r.num_tokens < r.request.prompt_len)

    def output_of(self, parent_id: str) -> RequestOutput:
        children = self._parents[parent_id]
        first = children[0]
        outs = [CompletionOutput(
            index=r.index, text=r.output_text, token_ids=list(r.output_token_ids),
            cumulative_logprob=r.cumulative_logprob if r.params.logprobs is not None else None,
            logprobs=list(r.output_logprobs) if r.params.logprobs is not None else None,
            finish_reason=r.finish_reason, stop_reason=r.stop_reason) for r in children]
        finished = all(r.status is Status.FINISHED for r in children)
        plp = first.params.prompt_logprobs is not None
        out = RequestOutput(
            request_id=parent_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if plp else None, outputs=outs,
            finished=finished, num_cached_tokens=first.num_cached_tokens,
            prompt_logprob_ranks=list(first.prompt_ranks) if plp else None)
        if finished:
            for r in children:
                self.requests.pop(r.request_id, None)
            self._parents.pop(parent_id, None)
        return out

    def cache_stats(self) -> dict:
        """Prefix-cache metrics: hit rates in tokens and requests, snapshots and their memory,
        evictions (empty when caching is off)."""
        return self.prefix_cache.stats() if self.prefix_cache else {}

    def check_integrity(self) -> None:
        """Every page reference, state slot and tree lock accounted for (tests call this)."""
        running = self.scheduler.running + self.scheduler.releasing
        slots = [r.state_slot for r in running]
        slots += [r.pending_slot for r in running if r.pending_slot >= 0]
        slots += [s for r in running for s in r.tree_snapshots.values() if s >= 0]
        if self.prefix_cache is None:
            assert len(slots) + self.state_pool.num_free == self.state_pool.num_slots
            assert len(set(slots)) == len(slots), "a state slot has two owners"
            assert all(c in (0, 1) for c in self.kv_pool.ref_count)
            held = [p for r in running for p in r.pages]
            assert len(set(held)) == len(held), "a KV page has two owners"
            assert len(held) + self.kv_pool.num_free == self.kv_pool.num_pages, "leaked pages"
            return
        self.prefix_cache.check_integrity([r.pages for r in running], slots,
                                          [r.cache_path for r in running])
