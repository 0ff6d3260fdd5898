"""AsyncEngine: an `LLMEngine` driven by one background thread, for asyncio servers.

The engine is not thread-safe, so exactly one thread (the loop started here) calls
`add_request`, `step` and `abort_request`. Callers on any asyncio event loop talk to it through a
command queue (add / abort) and get their outputs back on a per-request asyncio queue, filled
with `loop.call_soon_threadsafe` (one call per event loop per step); the per-request stream and
its metrics accounting live in `request_stream.py`.

    engine = AsyncEngine(LLMEngine(path, EngineConfig(...)), max_waiting=256)
    async for out in engine.generate("ROMEO:", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)          # cumulative, like LLMEngine.step()
    engine.shutdown(drain=True)

Errors reach the caller of `add_request` / `generate` as exceptions: `ValueError` for a request
the engine refuses (nothing is queued), `QueueFullError` when too many requests wait for
admission, `EngineClosedError` after shutdown began, `EngineStepError` when a forward failed
(every request in flight fails with it; the loop keeps serving the next ones).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from mambaserve.config import ModelConfig
from mambaserve.engine.llm_engine import LLMEngine
from mambaserve.engine.outputs import RequestOutput
from mambaserve.engine.request_stream import RequestStream, StreamState, deliver
from mambaserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("mambaserve.async_engine")


class QueueFullError(RuntimeError):
    """Too many requests are waiting for admission (the server answers 429)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down or stopped and takes no new requests (503)."""


class EngineStepError(RuntimeError):
    """A forward failed; the requests in flight at that moment were dropped (503)."""


@dataclass
class _Add:
    items: list[tuple[str, object, SamplingParams]]
    streams: list[StreamState]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    priority: int = 0  # every item's (LLMEngine.add_request)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable
    future: concurrent.futures.Future | None  # None: nobody waits for the result


@dataclass
class EngineSnapshot:
    """What /metrics and /health read: published by the engine thread, read by anyone."""

    running: int = 0
    waiting: int = 0
    state_slots_total: int = 0
    state_slots_free: int = 0
    kv_pages_total: int = 0
    kv_pages_free: int = 0
    steps: int = 0
    step_errors: int = 0
    preemptions: int = 0
    device_busy_seconds: float = 0.0
    cache: dict = field(default_factory=dict)
    time: float = 0.0


class AsyncEngine:
    """Owns an `LLMEngine` and the one thread that drives it (see the module docstring).

    `max_waiting`: how many sequences (a request with n=4 counts 4) may wait for admission
    beyond the free places under `max_num_seqs`; a request that would exceed it is refused with
    `QueueFullError`. None: no limit.
    `observer`: optional object with `on_first_token(ttft_s)`, `on_prompt(n_tokens)`,
    `on_tokens(n, gap_s)`, `on_finished(request_output, e2e_s)`, `on_aborted(n_seqs)`,
    `on_step(kind, seconds)` (kind: "prefill", "mixed" or "decode"),
    `on_rejected()` and `on_error(n_requests)`, called from the engine thread (the server's
    metrics); an observer that raises is logged and ignored.
    """

    def __init__(self, engine: LLMEngine, max_waiting: int | None = 256,
                 observer: object | None = None, publish_interval_s: float = 0.05) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.observer = observer
        self.publish_interval_s = publish_interval_s
        self._cv = threading.Condition()
        self._commands: list[object] = []
        self._streams: dict[str, StreamState] = {}
        self._accepting = True
        self._stop = False
        self._ids = itertools.count()
        self.step_errors = 0
        self.slow_step_s = 2.0  # a step longer than this is logged with its composition
        self._last_publish = 0.0
        self.snapshot = EngineSnapshot()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="mambaserve-engine", daemon=True)
        self._thread.start()

    # ---- properties ------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def scheduling_policy(self) -> str:
        """The engine's `EngineConfig.scheduling_policy` (immutable: safe from any thread)."""
        return self.engine.config.scheduling_policy

    @property
    def model_config(self) -> ModelConfig:
        """The served model's normalized config (immutable: safe from any thread)."""
        return self.engine.model_config

    def memory_report(self) -> dict:
        """State-pool and KV-pool sizes (fixed at start-up: safe from any thread)."""
        return self.engine.memory_report()

    @property
    def is_running(self) -> bool:
        """The loop thread is alive and new requests are taken."""
        return self._thread.is_alive() and self._accepting

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- public API (any thread with a running event loop) --------------------------------
    async def add_request(self, request_id: str | None, prompt, params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue one request; returns its output stream once the engine accepted it.
        Raises ValueError / QueueFullError / EngineClosedError (nothing queued then)."""
        streams = await self.add_requests([(request_id, prompt, params)], priority)
        return streams[0]

    async def add_requests(self, items: Sequence[tuple[str | None, object, SamplingParams]],
                           priority: int = 0) -> list[RequestStream]:
        """Queue several requests atomically: either all are accepted or none is queued.
        `priority` (vLLM's, for all of them) as `LLMEngine.add_request` takes it."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        fixed = [(rid if rid is not None else f"async-{next(self._ids)}", p, sp)
                 for rid, p, sp in items]
        streams = [StreamState(rid, loop, asyncio.Queue(), now) for rid, _, _ in fixed]
        fut = loop.create_future()
        self._submit(_Add(fixed, streams, loop, fut, priority))
        try:
            await fut
        except asyncio.CancelledError:
            # the caller went away while the command was queued: undo whatever got added
            for s in streams:
                self.abort(s.request_id)
            raise
        return [RequestStream(s, self.abort) for s in streams]

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs until it finishes. Closing the iterator early
        (or cancelling the task consuming it) aborts the request and frees its resources."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()  # no-op once finished

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once; unknown or finished ids are ignored)."""
        with self._cv:
            self._commands.append(_Abort(request_id))
            self._cv.notify()

    def call_sync(self, fn: Callable[[LLMEngine], object], timeout: float | None = 30.0):
        """Run `fn(engine)` on the engine thread between steps and return its result, blocking
        until it ran (for inspection in tests and tools: the engine must not be touched from
        other threads). Not for use from the event loop's thread."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, fut), check_open=False)
        return fut.result(timeout)

    def shutdown(self, drain: bool = True, timeout: float | None = 60.0) -> bool:
        """Stop taking requests; with `drain`, let the ones in flight finish first (up to
        `timeout` seconds, then abort them); without, abort them at once (their streams end
        with finish_reason "abort"). Blocks until the loop thread exited; True if it did (the
        engine is then closed: its tensor-parallel workers, if any, are stopped)."""
        with self._cv:
            self._accepting = False
            if not drain:
                self._commands.append(_Call(lambda e: self._abort_all(), None))
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout if drain else 10.0)
        if self._thread.is_alive() and drain:
            logger.warning("drain did not finish in %g s: aborting %d request(s)", timeout,
                           len(self._streams))
            with self._cv:
                self._commands.append(_Call(lambda e: self._abort_all(), None))
                self._cv.notify()
            self._thread.join(10.0)
        if self._thread.is_alive():
            return False
        self.engine.close()  # tensor parallelism: stop the worker ranks (nothing at one rank)
        return True

    async def ashutdown(self, drain: bool = True, timeout: float | None = 60.0) -> bool:
        return await asyncio.to_thread(self.shutdown, drain, timeout)

    # ---- submission ------------------------------------------------------------------------
    def _submit(self, cmd: object, check_open: bool = True) -> None:
        with self._cv:
            if check_open and not self._accepting:
                raise EngineClosedError("the engine is shutting down and takes no new requests")
            if not self._thread.is_alive() and self._thread.ident is not None:
                raise EngineClosedError("the engine loop is not running")
            self._commands.append(cmd)
            self._cv.notify()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                with self._cv:
                    while not self._commands and not self.engine.has_unfinished_requests():
                        if self._stop:
                            self._publish()
                            return
                        self._publish()
                        self._cv.wait()
                    commands, self._commands = self._commands, []
                for cmd in commands:
                    self._handle(cmd)
                if self.engine.has_unfinished_requests():
                    self._step()
                now = time.monotonic()
                if now - self._last_publish >= self.publish_interval_s:
                    self._publish()
            except Exception:  # a bug in this loop itself: log it, keep serving
                logger.exception("error in the engine loop")
                self._fail_all(EngineStepError("internal error in the engine loop"))
                time.sleep(0.01)

    def _handle(self, cmd: object) -> None:
        try:
            if isinstance(cmd, _Add):
                self._handle_add(cmd)
            elif isinstance(cmd, _Abort):
                self._handle_abort(cmd.request_id)
            elif isinstance(cmd, _Call):
                self._handle_call(cmd)
        except Exception:
            logger.exception("error handling %s", type(cmd).__name__)

    def _handle_add(self, cmd: _Add) -> None:
        if cmd.future.cancelled():
            return
        if not self._accepting:
            return _resolve(cmd.loop, cmd.future, EngineClosedError(
                "the engine is shutting down and takes no new requests"))
        e = self.engine
        if self.max_waiting is not None:
            need = sum(sp.n for _, _, sp in cmd.items)
            seats = max(0, e.config.max_num_seqs - e.num_running)
            if e.num_waiting + need - seats > self.max_waiting:
                self._observe("on_rejected")
                return _resolve(cmd.loop, cmd.future, QueueFullError(
                    f"too many requests waiting ({e.num_waiting} sequences queued, limit "
                    f"{self.max_waiting}); retry later"))
        added: list[str] = []
        try:
            for rid, prompt, params in cmd.items:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in use")
                self.engine.add_request(rid, prompt, params, priority=cmd.priority)
                added.append(rid)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            for rid in added:
                self.engine.abort_request(rid)
            err = e if isinstance(e, ValueError) else EngineStepError(f"add_request failed: {e!r}")
            return _resolve(cmd.loop, cmd.future, err)
        for s in cmd.streams:
            self._streams[s.request_id] = s
        _resolve(cmd.loop, cmd.future, None)

    def _handle_abort(self, rid: str) -> None:
        s = self._streams.pop(rid, None)
        n = self.engine.sequences_of(rid)  # sequences still held
        if self.engine.abort_request(rid) and s is not None:
            self._observe("on_aborted", n)

    def _handle_call(self, cmd: _Call) -> None:
        try:
            result, err = cmd.fn(self.engine), None
        except Exception as e:  # noqa: BLE001 - reported to the caller
            result, err = None, e
        if cmd.future is None:
            return
        if err is None:
            cmd.future.set_result(result)
        else:
            cmd.future.set_exception(err)

    def _step(self) -> None:
        t0 = time.monotonic()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self.step_errors += 1
            logger.exception("engine step failed; failing %d request(s) in flight",
                             len(self._streams))
            self._fail_all(EngineStepError(f"the engine failed while running this request: "
                                           f"{type(e).__name__}: {e}"))
            try:
                self.engine.check_integrity()
            except Exception:
                logger.exception("engine integrity check failed after the error")
            return
        now = time.monotonic()
        if self.engine.last_step is not None:
            kind, prefill_tokens, decode_rows = self.engine.last_step
            self._observe("on_step", kind, now - t0)
            if now - t0 > self.slow_step_s:
                logger.warning(
                    "slow engine step: %.2f s for a %s step (%d prefill tokens, %d decode rows); "
                    "the first steps of new batch shapes may include Triton JIT compiles",
                    now - t0, kind, prefill_tokens, decode_rows)
        items = []
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:
                continue
            s.account(out, now, self._observe)
            items.append((s, out))
            if out.finished:
                del self._streams[out.request_id]
        for s in deliver(items):  # their event loop is closed: nobody will read these
            if self._streams.pop(s.request_id, None) is not None:
                self.engine.abort_request(s.request_id)

    def _observe(self, name: str, *args) -> None:
        if self.observer is not None:
            try:
                getattr(self.observer, name)(*args)
            except Exception:
                logger.exception("metrics observer %s failed", name)

    def _fail_all(self, err: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            try:
                self.engine.abort_request(s.request_id)
            except Exception:
                logger.exception("abort of %s failed", s.request_id)
        self._observe("on_error", len(streams))
        deliver([(s, err) for s in streams])
        # anything left in the engine without a stream (should not happen) goes too
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort_request(rid)

    def _abort_all(self) -> None:
        """Abort every request in flight; each stream ends with finish_reason "abort"."""
        items = []
        for rid, s in list(self._streams.items()):
            out = self.engine.abort_with_output(rid)
            if out is None:  # not in the engine (should not happen): the stream still ends
                items.append((s, EngineStepError(f"request {rid} was no longer in the engine")))
                continue
            self._observe("on_aborted", len(out.outputs))
            items.append((s, out))
        self._streams.clear()
        deliver(items)

    def _publish(self) -> None:
        e = self.engine
        now = time.monotonic()
        try:  # counters kept by the cache as it changes (no walk over the tree)
            cache = e.cache_stats()
        except Exception:  # noqa: BLE001 - metrics must not stop the loop
            cache = {}
        self.snapshot = EngineSnapshot(
            running=e.num_running, waiting=e.num_waiting,
            state_slots_total=e.state_pool.num_slots, state_slots_free=e.state_pool.num_free,
            kv_pages_total=e.kv_pool.num_pages, kv_pages_free=e.kv_pool.num_free,
            steps=e.stats.get("steps", 0), step_errors=self.step_errors, cache=cache,
            preemptions=e.stats.get("preemptions", 0),
            device_busy_seconds=e.stats.get("device_busy_seconds", 0.0),
            time=now)
        self._last_publish = now


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future,
             err: BaseException | None) -> None:
    """Settle an add command's future on its caller's loop: accepted (None) or refused."""
    def done() -> None:
        if fut.done():
            return
        if err is not None:
            fut.set_exception(err)
        else:
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass


__all__ = [
    "AsyncEngine",
    "EngineClosedError",
    "EngineSnapshot",
    "EngineStepError",
    "QueueFullError",
    "RequestStream",
]
