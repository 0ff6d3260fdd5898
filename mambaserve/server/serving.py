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
from mambaserve.engine.request_queue import check_priority
from mambaserve.server.chat_output import ChatChoiceOutput
from mambaserve.server.fields import APIError, dumps
from mambaserve.server.logprobs import (
    TokenText,
    chat_logprobs,
    completion_logprobs,
    concat_logprobs,
    prompt_logprobs,
)
from mambaserve.server.protocol import ParsedRequest

logger = logging.getLogger("mambaserve.server")

TOKEN_IDS = TokenText(None)  # names every token "token_id:N"


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


# ---- helpers ---------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {dumps(obj)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; with `cached_tokens` (--enable-prompt-tokens-details) also
    `prompt_tokens_details.cached_tokens`: the prompt tokens reused from the prefix cache."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


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
    def __init__(self, engine: AsyncEngine, model_name: str,
                 prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tt = TokenText(engine.tokenizer)
        self.prompt_tokens_details = prompt_tokens_details

    def _cached(self, counts) -> int | None:
        """The usage's cached_tokens: each prompt's prefix-cache hit once (as prompt_tokens
        counts each prompt once, whatever n), summed; None (no field) unless enabled."""
        return sum(counts) if self.prompt_tokens_details else None

    async def submit(self, parsed: ParsedRequest, prefix: str) -> tuple[str, list[RequestStream]]:
        try:  # a priority other than 0 under fcfs: a 400 naming the field (vLLM's rule)
            check_priority(parsed.priority, self.engine.scheduling_policy)
        except ValueError as e:
            raise APIError(str(e), param="priority", code="invalid_value") from None
        rid = f"{prefix}-{uuid.uuid4().hex}"
        items = [(rid if len(parsed.prompts) == 1 else f"{rid}-p{i}",
                  {"prompt_token_ids": p.token_ids, "prompt": p.text,
                   "cache_salt": parsed.cache_salt}, parsed.params)
                 for i, p in enumerate(parsed.prompts)]
        try:
            streams = await self.engine.add_requests(items, parsed.priority)
        except Exception as e:  # noqa: BLE001 - mapped to an HTTP error
            raise engine_error(e) from None
        return rid, streams

    def _tt(self, parsed: ParsedRequest) -> TokenText:
        """How this request's logprobs name tokens: by their text, or "token_id:N"."""
        return TOKEN_IDS if parsed.token_ids_as_text else self.tt

    def _echo_text(self, parsed: ParsedRequest, p: int) -> str:
        prompt = parsed.prompts[p]
        if prompt.text is not None:
            return prompt.text
        tok = self.engine.tokenizer
        return tok.decode(prompt.token_ids, skip_special_tokens=False) if tok else ""

    def _prompt_logprobs(self, parsed: ParsedRequest, out: RequestOutput) -> tuple[dict, int]:
        """The echoed prompt's logprobs object (first token null) -> (object, text offset)."""
        ids = out.prompt_token_ids
        return completion_logprobs(self._tt(parsed), ids, out.prompt_logprobs, 0, len(ids),
                                   parsed.logprobs, 0)

    def _vllm_prompt_logprobs(self, parsed: ParsedRequest, out: RequestOutput) -> list:
        """vLLM's prompt_logprobs of one prompt. Its tokens' texts are their own (vLLM's
        decoded_token, which return_tokens_as_token_ids leaves alone; null without a
        tokenizer)."""
        text = self.tt if self.engine.tokenizer is not None else (lambda t: None)
        return prompt_logprobs(text, out.prompt_token_ids, out.prompt_logprobs,
                               out.prompt_logprob_ranks, parsed.prompt_logprobs)

    def _body(self, rid: str, created: int, obj: str, choices: list, usage: dict) -> dict:
        return {"id": rid, "object": obj, "created": created, "model": self.model_name,
                "choices": choices, "system_fingerprint": None, "usage": usage}

    # ---- /v1/completions ---------------------------------------------------------------------
    def completion_body(self, rid: str, created: int, parsed: ParsedRequest,
                        outs: list[RequestOutput]) -> dict:
        choices, n_prompt, n_gen = [], 0, 0
        for p, out in enumerate(outs):
            n_prompt += len(out.prompt_token_ids)
            echo = self._echo_text(parsed, p) if parsed.echo else ""
            plp = None
            if parsed.prompt_logprobs is not None:
                plp = self._vllm_prompt_logprobs(parsed, out)
            for c in out.outputs:
                end = 0 if parsed.echo_only else len(c.token_ids)
                n_gen += end
                lp = None
                if parsed.logprobs is not None:
                    offset, head = len(echo), None
                    if parsed.echo:
                        head, offset = self._prompt_logprobs(parsed, out)
                    lp, _ = completion_logprobs(self._tt(parsed), c.token_ids, c.logprobs, 0, end,
                                                parsed.logprobs, offset)
                    lp = concat_logprobs(head, lp) if head is not None else lp
                text = echo if parsed.echo_only else echo + c.text
                finish = "length" if parsed.echo_only and c.finish_reason != "abort" \
                    else c.finish_reason
                choices.append({"index": p * parsed.n + c.index, "text": text,
                                "logprobs": lp, "finish_reason": finish})
                if plp is not None:  # vLLM's extension, in every choice of the prompt
                    choices[-1]["prompt_logprobs"] = plp
        choices.sort(key=lambda ch: ch["index"])
        return self._body(rid, created, "text_completion", choices, _usage(
            n_prompt, n_gen, self._cached(o.num_cached_tokens for o in outs)))

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
                lp = {"content": chat_logprobs(self._tt(parsed), c.token_ids, c.logprobs, 0,
                                               len(c.token_ids), parsed.logprobs),
                      "refusal": None}
            message, called = ChatChoiceOutput(parsed.chat).message(c.text)
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": _chat_finish(c.finish_reason, called)})
        body = self._body(rid, created, "chat.completion", choices,
                          _usage(len(out.prompt_token_ids), n_gen,
                                 self._cached([out.num_cached_tokens])))
        if parsed.prompt_logprobs is not None:  # vLLM's extension, at the top level
            body["prompt_logprobs"] = self._vllm_prompt_logprobs(parsed, out)
        return body

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
        outputs: dict[int, ChatChoiceOutput] = {}
        offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        gen_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}  # per prompt, known once the engine admitted it
        usage_field = parsed.include_usage or parsed.continuous_usage
        # echo with logprobs: the prompt goes out once its logprobs are known (after prefill)
        late_echo = not chat and parsed.echo and parsed.logprobs is not None
        pending_echo: set[int] = set()

        def chunk(choices: list[dict]) -> str:
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                    "system_fingerprint": None, "choices": choices}
            if parsed.continuous_usage:
                g = sum(gen_tokens.values())
                body["usage"] = _usage(sum(prompt_tokens.values()), g,
                                       self._cached(cached.values()))
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
                        outputs[idx] = ChatChoiceOutput(parsed.chat)
                        role = outputs[idx].spec.role
                        yield chunk([{"index": idx, "delta": {"role": role, "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    elif late_echo:
                        pending_echo.add(idx)
                    elif parsed.echo:
                        text = self._echo_text(parsed, p)
                        offsets[idx] = len(text)
                        yield chunk([{"index": idx, "text": text, "logprobs": None,
                                      "finish_reason": None}])
            for idx, output in outputs.items():  # chat echo: after all the role chunks
                if d := output.echo_delta():
                    yield chunk([{"index": idx, "delta": d, "logprobs": None,
                                  "finish_reason": None}])
            async for p, out in merge(streams):
                cached[p] = out.num_cached_tokens
                for c in out.outputs:
                    idx = p * n + c.index
                    tr = trackers[idx]
                    if tr.done or (len(c.token_ids) == tr.num_tokens and c.finish_reason is None):
                        continue
                    if idx in pending_echo:
                        pending_echo.discard(idx)
                        lp, offsets[idx] = self._prompt_logprobs(parsed, out)
                        yield chunk([{"index": idx, "text": self._echo_text(parsed, p),
                                      "logprobs": lp, "finish_reason": None}])
                    delta, start, end = tr.advance(c)
                    if parsed.echo_only:  # the one generated token is not returned
                        delta, end = "", 0
                        if c.finish_reason is None:
                            continue
                    gen_tokens[idx] = end
                    if chat:
                        choice = self._chat_choice(parsed, outputs[idx], tr, c, start, end)
                        if choice is None:
                            continue
                    else:
                        lp = None
                        if parsed.logprobs is not None:
                            lp, offsets[idx] = completion_logprobs(
                                self._tt(parsed), c.token_ids, c.logprobs, start, end,
                                parsed.logprobs, offsets.get(idx, 0))
                        finish = c.finish_reason
                        if parsed.echo_only and finish is not None and finish != "abort":
                            finish = "length"
                        choice = {"index": idx, "text": delta, "logprobs": lp,
                                  "finish_reason": finish}
                    yield chunk([choice])
            if parsed.include_usage:
                yield sse(self._body(rid, created, obj, [], _usage(
                    sum(prompt_tokens.values()), sum(gen_tokens.values()),
                    self._cached(cached.values()))))
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

    def _chat_choice(self, parsed: ParsedRequest, output: ChatChoiceOutput, tr: ChoiceTracker,
                     c: CompletionOutput, start: int, end: int) -> dict | None:
        """A chat chunk's choice for the text sent so far; None when it carries nothing."""
        lp = None
        if parsed.logprobs is not None:
            lp = {"content": chat_logprobs(self._tt(parsed), c.token_ids, c.logprobs, start, end,
                                           parsed.logprobs), "refusal": None}
        d = output.delta(tr.sent, c.finish_reason is not None)
        if not d and c.finish_reason is None and not (lp and lp["content"]):
            return None
        return {"index": c.index, "delta": d, "logprobs": lp,
                "finish_reason": _chat_finish(c.finish_reason, output.called_tools)
                if c.finish_reason is not None else None}


def _chat_finish(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's finish_reason "tool_calls" when the choice stopped after calling tools."""
    return "tool_calls" if called_tools and reason == "stop" else reason
