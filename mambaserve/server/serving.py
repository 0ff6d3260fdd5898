"""/v1/completions and /v1/chat/completions: engine outputs -> OpenAI response bodies and SSE
chunks (the exact shapes of OpenAI's API), streaming and not."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from mambaserve.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineStepError,
    QueueFullError,
    RequestStream,
)
from mambaserve.engine.outputs import CompletionOutput, RequestOutput
from mambaserve.server.protocol import APIError, ParsedRequest, dumps

logger = logging.getLogger("mambaserve.server")


def engine_error(e: BaseException) -> APIError:
    """Map what the AsyncEngine raises to the HTTP error the client gets."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, QueueFullError):
        return APIError(str(e), status=429, type="rate_limit_error", code="queue_full")
    if isinstance(e, EngineClosedError):
        return APIError(str(e), status=503, type="server_error", code="shutting_down")
    if isinstance(e, EngineStepError):
        return APIError(str(e), status=503, type="server_error", code="engine_error")
    if isinstance(e, ValueError):
        return APIError(str(e), status=400, code="invalid_value")
    logger.error("unexpected error", exc_info=e)
    return APIError(f"internal error: {type(e).__name__}: {e}", status=503, type="server_error",
                    code="internal_error")


# ---- text deltas -----------------------------------------------------------------------------
class ChoiceTracker:
    """What one streamed choice has sent so far. While a choice runs, the text is held back by
    (longest stop string - 1) characters, which a stop string found later could still cut, and
    by trailing U+FFFD (an incomplete UTF-8 sequence the next token may complete), so every
    sent delta is a prefix of the final text."""

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.sent = ""
        self.num_tokens = 0
        self.done = False

    def advance(self, comp: CompletionOutput) -> tuple[str, int, int]:
        """-> (new text, first new token index, end token index)."""
        text = comp.text
        if comp.finish_reason is not None:
            upto = len(text)
            self.done = True
        else:
            upto = max(0, len(text) - self.holdback)
            while upto > 0 and text[upto - 1] == "\ufffd":
                upto -= 1
        if not text.startswith(self.sent):
            # cannot happen with the hold-back above; never resend or retract what was sent
            logger.warning("streamed text diverged from the final text of a choice")
        delta = text[len(self.sent):upto] if upto > len(self.sent) else ""
        self.sent += delta
        start, self.num_tokens = self.num_tokens, len(comp.token_ids)
        return delta, start, self.num_tokens


# ---- logprobs --------------------------------------------------------------------------------
class TokenText:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tok is None:
            return f"token_id:{token_id}"
        return self.tok.token_text(token_id)


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tt: TokenText, comp: CompletionOutput, start: int, end: int, k: int,
                        offset: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for tokens [start, end); -> (object, next offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    lps = comp.logprobs or []
    for i in range(start, end):
        tid = comp.token_ids[i]
        d = lps[i] if i < len(lps) else {}
        text = tt(tid)
        tokens.append(text)
        token_lps.append(d.get(tid))
        if k:
            top: dict[str, float] = {}
            for t, lp in _top(d, k):
                top.setdefault(tt(t), lp)  # tokens with the same text: keep the likeliest
            tops.append(top)
        else:
            tops.append(None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}, offset


def _lp_entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tt: TokenText, comp: CompletionOutput, start: int, end: int, k: int) -> list:
    out = []
    lps = comp.logprobs or []
    for i in range(start, end):
        tid = comp.token_ids[i]
        d = lps[i] if i < len(lps) else {}
        e = _lp_entry(tt(tid), d.get(tid, float("-inf")))
        e["top_logprobs"] = [_lp_entry(tt(t), lp) for t, lp in _top(d, k)]
        out.append(e)
    return out


# ---- helpers ---------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, None, e))
            return
        q.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(streams: list[RequestStream], receive=None) -> list[RequestOutput]:
    """The final output of every stream; aborts them all if the client disconnects (then
    raises ClientDisconnected) or one of them fails."""

    async def last(s: RequestStream) -> RequestOutput:
        out = None
        async for out in s:
            pass
        return out

    work = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
    watch = asyncio.ensure_future(_wait_disconnect(receive)) if receive is not None else None
    try:
        if watch is None:
            return await work
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        raise ClientDisconnected()
    finally:
        if watch is not None:
            watch.cancel()
        if not work.done():
            work.cancel()
            # a cancelled gather keeps a CancelledError asyncio would log as never retrieved
            work.add_done_callback(lambda f: f.cancelled() or f.exception())
        for s in streams:
            s.abort()


# ---- the endpoints ---------------------------------------------------------------------------
class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tt = TokenText(engine.tokenizer)

    async def submit(self, parsed: ParsedRequest, prefix: str) -> tuple[str, list[RequestStream]]:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        items = [(rid if len(parsed.prompts) == 1 else f"{rid}-p{i}",
                  {"prompt_token_ids": p.token_ids, "prompt": p.text}, parsed.params)
                 for i, p in enumerate(parsed.prompts)]
        try:
            streams = await self.engine.add_requests(items)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise engine_error(e) from None
        return rid, streams

    def _echo_text(self, parsed: ParsedRequest, p: int) -> str:
        prompt = parsed.prompts[p]
        if prompt.text is not None:
            return prompt.text
        tok = self.engine.tokenizer
        return tok.decode(prompt.token_ids, skip_special_tokens=False) if tok else ""

    # ---- /v1/completions ---------------------------------------------------------------------
    def completion_body(self, rid: str, created: int, parsed: ParsedRequest,
                        outs: list[RequestOutput]) -> dict:
        choices, n_prompt, n_gen = [], 0, 0
        for p, out in enumerate(outs):
            n_prompt += len(out.prompt_token_ids)
            echo = self._echo_text(parsed, p) if parsed.echo else ""
            for c in out.outputs:
                n_gen += len(c.token_ids)
                lp = None
                if parsed.logprobs is not None:
                    lp, _ = completion_logprobs(self.tt, c, 0, len(c.token_ids), parsed.logprobs,
                                                len(echo))
                choices.append({"index": p * parsed.n + c.index, "text": echo + c.text,
                                "logprobs": lp, "finish_reason": c.finish_reason})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "system_fingerprint": None,
                "usage": _usage(n_prompt, n_gen)}

    async def completions(self, parsed: ParsedRequest, receive) -> dict | AsyncIterator[str]:
        rid, streams = await self.submit(parsed, "cmpl")
        created = int(time.time())
        if parsed.stream:
            return self._stream(rid, created, parsed, streams, chat=False)
        try:
            outs = await collect(streams, receive)
        except (EngineStepError, EngineClosedError) as e:
            raise engine_error(e) from None
        return self.completion_body(rid, created, parsed, outs)

    # ---- /v1/chat/completions ----------------------------------------------------------------
    def chat_body(self, rid: str, created: int, parsed: ParsedRequest,
                  out: RequestOutput) -> dict:
        choices, n_gen = [], 0
        for c in out.outputs:
            n_gen += len(c.token_ids)
            lp = None
            if parsed.logprobs is not None:
                lp = {"content": chat_logprobs(self.tt, c, 0, len(c.token_ids), parsed.logprobs),
                      "refusal": None}
            choices.append({"index": c.index,
                            "message": {"role": "assistant", "content": c.text, "refusal": None,
                                        "tool_calls": []},
                            "logprobs": lp, "finish_reason": c.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices, "system_fingerprint": None,
                "usage": _usage(len(out.prompt_token_ids), n_gen)}

    async def chat(self, parsed: ParsedRequest, receive) -> dict | AsyncIterator[str]:
        rid, streams = await self.submit(parsed, "chatcmpl")
        created = int(time.time())
        if parsed.stream:
            return self._stream(rid, created, parsed, streams, chat=True)
        try:
            outs = await collect(streams, receive)
        except (EngineStepError, EngineClosedError) as e:
            raise engine_error(e) from None
        return self.chat_body(rid, created, parsed, outs[0])

    # ---- streaming ---------------------------------------------------------------------------
    async def _stream(self, rid: str, created: int, parsed: ParsedRequest,
                      streams: list[RequestStream], chat: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        n = parsed.n
        holdback = max((len(s) for s in parsed.stop), default=1) - 1
        trackers: dict[int, ChoiceTracker] = {}
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        gen_tokens: dict[int, int] = {}
        usage_field = parsed.include_usage or parsed.continuous_usage

        def chunk(choices: list[dict]) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "system_fingerprint": None, "choices": choices}
            if parsed.continuous_usage:
                g = sum(gen_tokens.values())
                body["usage"] = _usage(sum(prompt_tokens.values()), g)
            elif usage_field:
                body["usage"] = None
            return sse(body)

        try:
            # the opening chunks: chat announces the role, echo sends the prompts
            for p in range(len(streams)):
                prompt_tokens[p] = len(parsed.prompts[p].token_ids)
                for j in range(n):
                    idx = p * n + j
                    trackers[idx] = ChoiceTracker(holdback)
                    gen_tokens[idx] = 0
                    if chat:
                        yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    elif parsed.echo:
                        text = self._echo_text(parsed, p)
                        offsets[idx] = len(text)
                        yield chunk([{"index": idx, "text": text, "logprobs": None,
                                      "finish_reason": None}])
            async for p, out in merge(streams):
                for c in out.outputs:
                    idx = p * n + c.index
                    tr = trackers[idx]
                    if tr.done or (len(c.token_ids) == tr.num_tokens and c.finish_reason is None):
                        continue
                    delta, start, end = tr.advance(c)
                    gen_tokens[idx] = end
                    lp = None
                    if chat:
                        if parsed.logprobs is not None:
                            lp = {"content": chat_logprobs(self.tt, c, start, end,
                                                           parsed.logprobs), "refusal": None}
                        d = {"content": delta} if delta or c.finish_reason is None else {}
                        choice = {"index": idx, "delta": d, "logprobs": lp,
                                  "finish_reason": c.finish_reason}
                    else:
                        if parsed.logprobs is not None:
                            lp, offsets[idx] = completion_logprobs(
                                self.tt, c, start, end, parsed.logprobs, offsets.get(idx, 0))
                        choice = {"index": idx, "text": delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason}
                    yield chunk([choice])
            if parsed.include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                        "system_fingerprint": None, "choices": [],
                        "usage": _usage(sum(prompt_tokens.values()), sum(gen_tokens.values()))}
                yield sse(body)
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the response has started: report in-band
            err = engine_error(e)
            yield sse(err.body())
            yield "data: [DONE]\n\n"
        finally:
            for s in streams:
                s.abort()
