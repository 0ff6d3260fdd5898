"""mambaserve.engine.request_stream without an engine: the metrics accounting of outputs, the
coalescing iterator, and delivery to open and closed event loops."""

from __future__ import annotations

import asyncio

import pytest

from mambaserve.engine.outputs import CompletionOutput, RequestOutput
from mambaserve.engine.request_stream import RequestStream, StreamState, deliver


def output(n_tokens: int, finished: bool = False, rid: str = "r") -> RequestOutput:
    done = CompletionOutput(0, "", list(range(n_tokens)), None, None,
                            "length" if finished else None)
    return RequestOutput(rid, None, [1, 2, 3], None, [done], finished)


def test_account_reports_first_token_then_increments_then_finish():
    s = StreamState("r", asyncio.new_event_loop(), asyncio.Queue(), arrival=10.0)
    events = []

    def observe(*e):
        events.append(e)

    s.account(output(0), 10.5, observe)  # a prefill chunk: nothing generated yet
    s.account(output(1), 11.0, observe)
    s.account(output(3), 11.5, observe)
    fin = output(3, finished=True)
    s.account(fin, 12.0, observe)
    assert events == [("on_first_token", 1.0), ("on_prompt", 3), ("on_tokens", 2, 0.5),
                      ("on_finished", fin, 2.0)]
    s.loop.close()


def test_stream_coalesces_and_ends():
    async def main():
        q = asyncio.Queue()
        aborted = []
        stream = RequestStream(StreamState("r", asyncio.get_running_loop(), q, 0.0),
                               aborted.append)
        for n in (1, 2, 3):
            q.put_nowait(output(n))
        got = [len((await stream.__anext__()).outputs[0].token_ids)]
        q.put_nowait(output(4, finished=True))
        q.put_nowait(output(5))  # never read: the stream ended at the finished output
        got += [len(o.outputs[0].token_ids) async for o in stream]
        stream.abort()  # finished: no abort reaches the engine
        return got, aborted

    # the newest of the piled-up outputs, then the finished one, which ends the stream
    assert asyncio.run(main()) == ([3, 4], [])


def test_stream_raises_the_engine_error_and_aborts_once():
    async def main():
        q = asyncio.Queue()
        aborted = []
        stream = RequestStream(StreamState("r", asyncio.get_running_loop(), q, 0.0),
                               aborted.append)
        q.put_nowait(output(1))
        q.put_nowait(RuntimeError("engine failed"))
        with pytest.raises(RuntimeError, match="engine failed"):
            async for _ in stream:
                pass
        other = RequestStream(StreamState("x", asyncio.get_running_loop(), asyncio.Queue(), 0),
                              aborted.append)
        other.abort()
        other.abort()
        return aborted

    assert asyncio.run(main()) == ["x"]


def test_deliver_returns_the_streams_of_closed_loops():
    live, dead = asyncio.new_event_loop(), asyncio.new_event_loop()
    dead.close()
    a = StreamState("a", live, asyncio.Queue(), 0.0)
    b = StreamState("b", live, asyncio.Queue(), 0.0)
    c = StreamState("c", dead, asyncio.Queue(), 0.0)
    err = RuntimeError("x")
    assert deliver([(a, output(1, rid="a")), (c, output(1, rid="c")), (b, err)]) == [c]
    live.run_until_complete(asyncio.sleep(0))  # runs the scheduled put
    assert a.queue.get_nowait().request_id == "a" and b.queue.get_nowait() is err
    assert c.queue.empty()
    live.close()
