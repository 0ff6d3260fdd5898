"""One request's output stream between `AsyncEngine`'s thread and the asyncio caller.

`StreamState` is what the engine thread keeps per request: the caller's event loop and queue, and
the token count and time of the last output, from which it derives the metrics events (first
token, tokens since the last output, finished). `RequestStream` is the caller's side: an async
iterator over the queue, which coalesces outputs that piled up (they are cumulative).
`deliver` hands outputs from the engine thread to the callers' event loops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from mambaserve.engine.outputs import RequestOutput


@dataclass
class StreamState:
    """The engine thread's record of one request in flight (see the module docstring)."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # time.monotonic() when the request was submitted
    num_tokens: int = 0  # generated so far, all completions together
    last_token_time: float | None = None

    def account(self, out: RequestOutput, now: float, observe: Callable[..., None]) -> None:
        """Report what `out` adds since the previous output as observer events:
        on_first_token + on_prompt, or on_tokens; on_finished at the end."""
        n = sum(len(c.token_ids) for c in out.outputs)
        if n > self.num_tokens:
            if self.last_token_time is None:
                observe("on_first_token", now - self.arrival)
                observe("on_prompt", len(out.prompt_token_ids))
            else:
                observe("on_tokens", n - self.num_tokens, now - self.last_token_time)
            self.num_tokens, self.last_token_time = n, now
        if out.finished:
            observe("on_finished", out, now - self.arrival)


class RequestStream:
    """Async iterator over one request's cumulative outputs. Outputs that pile up while the
    consumer is busy are coalesced: the iterator yields the newest (they are cumulative). An
    exception put on the queue (the engine failed) is raised to the consumer."""

    def __init__(self, state: StreamState, abort: Callable[[str], None]) -> None:
        self._s = state
        self._abort = abort
        self.request_id = state.request_id
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        q = self._s.queue
        item = await q.get()
        while not isinstance(item, BaseException) and not item.finished and not q.empty():
            item = q.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it finished (the engine frees its slot and pages)."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


def deliver(items: list[tuple[StreamState, object]]) -> list[StreamState]:
    """Put each (stream, output or exception) on its stream's queue, with one
    `call_soon_threadsafe` per event loop (called from the engine thread). Returns the streams
    whose event loop is closed: nobody will read them."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StreamState, object]]] = {}
    for s, item in items:
        by_loop.setdefault(s.loop, []).append((s, item))
    lost = []
    for loop, group in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, [(s.queue, item) for s, item in group])
        except RuntimeError:
            lost += [s for s, _ in group]
    return lost


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
