"""The FastAPI application: OpenAI-compatible routes over one AsyncEngine.

Every route catches everything at its boundary: a client error is a 4xx with OpenAI's error
body, the engine's own trouble a 503, and no request ever gets a 500. Before a route runs, the
guards answer (each with OpenAI's error body): a Host header outside `allowed_hosts` (400), an
`Origin` outside `allowed_origins` (403), a missing or wrong API key on /v1/* (401), a POST
that is not `application/json` (415), a body over `max_body_bytes` (413) or slower than
`body_timeout_s` (408). Reading the JSON, tokenizing and rendering chat templates run on a small
thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hmac
import ipaddress
import logging
import os
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse

from mambaserve import __version__
from mambaserve.engine.async_engine import AsyncEngine
from mambaserve.server.chat_request import ChatConfig
from mambaserve.server.fields import APIError, dumps, get_str, parse_json
from mambaserve.server.metrics import CONTENT_TYPE, Metrics
from mambaserve.server.protocol import parse_chat, parse_completion
from mambaserve.server.reasoning_parsers import reasoning_parser_class
from mambaserve.server.serving import ClientDisconnected, OpenAIServing, engine_error
from mambaserve.server.tokenize import detokenize, tokenize
from mambaserve.server.tool_parsers import get_tool_parser

logger = logging.getLogger("mambaserve.server")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/version", "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")
DEFAULT_MAX_BODY_BYTES = 4 << 20
LOOPBACK_NAMES = ("localhost", "*.localhost")


class SafeJSONResponse(JSONResponse):
    """JSON as UTF-8; a string that cannot be UTF-8 (a lone surrogate sent by a client and
    quoted back in an error) is written as a \\u escape instead of failing the response."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


def error_response(e: APIError, headers: dict | None = None) -> SafeJSONResponse:
    return SafeJSONResponse(e.body(), status_code=e.status, headers=headers)


async def _send_error(scope, receive, send, e: APIError, headers: dict | None = None) -> None:
    """Answer from a guard (pure ASGI) without reading the body. The connection stays open:
    uvicorn reads and drops the rest of a body of declared length (the client then reads its
    answer instead of a reset), within the header timeout of launcher.py."""
    await error_response(e, headers)(scope, receive, send)


class _HTTPMetrics:
    """Pure ASGI middleware counting responses by path and status (streaming-safe)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path not in ROUTES:
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                self.metrics.on_http(path, message["status"])
            await send(message)

        return await self.app(scope, receive, send_wrapper)


def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v.decode("latin-1")
    return None


def _host_name(host: str) -> str:
    """The host part of a Host header ('[::1]:8000' -> '::1', 'Example.COM:80' -> 'example.com')."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(addr) -> bool:
    try:
        return ipaddress.ip_address(str(addr)).is_loopback
    except ValueError:
        return False


def _host_matches(host: str, patterns: Sequence[str]) -> bool:
    for p in patterns:
        p = p.strip().lower()
        if p == "*" or p == host or (p.startswith("*.") and host.endswith(p[1:])):
            return True
    return False


class _HostOriginGuard:
    """The outermost guard: DNS rebinding (the Host header) and cross-site browsers (Origin).

    `allowed_hosts` None: on a connection that came in on a loopback address, only IP literals
    and localhost names are accepted (a rebinding attack needs a domain name of its own);
    elsewhere any Host. `allowed_origins`: the browser origins that may call the server (CORS);
    a request with an `Origin` header not in it is refused with 403 (non-browser clients send no
    Origin)."""

    def __init__(self, app, allowed_hosts: Sequence[str] | None,
                 allowed_origins: Sequence[str]) -> None:
        self.app = app
        self.allowed_hosts = list(allowed_hosts) if allowed_hosts is not None else None
        self.allowed_origins = set(allowed_origins)

    def _host_ok(self, scope) -> bool:
        raw = _header(scope, b"host")
        if raw is None:
            return True  # HTTP/1.0 without Host: no browser sends that
        host = _host_name(raw)
        if self.allowed_hosts is not None:
            return _host_matches(host, self.allowed_hosts)
        server = scope.get("server")
        if server and _is_loopback(server[0]):
            return _is_ip(host) or _host_matches(host, LOOPBACK_NAMES)
        return True

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._host_ok(scope):
            host = _header(scope, b"host") or ""
            return await _send_error(scope, receive, send, APIError(
                f"host {host[:100]!r} is not allowed; start the server with --allowed-hosts to "
                "accept it", status=400, code="invalid_host"))
        origin = _header(scope, b"origin")
        if origin is not None and "*" not in self.allowed_origins and \
                origin not in self.allowed_origins:
            return await _send_error(scope, receive, send, APIError(
                f"cross-origin requests from {origin[:100]!r} are not allowed; start the server "
                "with --allowed-origins to allow a browser origin", status=403,
                type="permission_error", code="origin_not_allowed"))
        return await self.app(scope, receive, send)


class _APIGuard:
    """API key on /v1/* (and /tokenize, /detokenize), JSON-only POSTs, the declared body size
    (inside CORS, so a browser that is allowed reads these errors too)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        method = scope.get("method", "")
        guarded = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        if self.api_key and guarded and method != "OPTIONS":
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode("utf-8", "replace"), self.api_key.encode("utf-8")):
                return await _send_error(scope, receive, send, APIError(
                    "a valid API key is required: send it as 'Authorization: Bearer KEY'",
                    status=401, code="invalid_api_key"), {"WWW-Authenticate": "Bearer"})
        if method == "POST" and guarded:
            ctype = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return await _send_error(scope, receive, send, APIError(
                    f"the request body must be JSON sent as 'Content-Type: application/json', "
                    f"got {ctype[:60] or 'no Content-Type'!r}", status=415,
                    code="unsupported_media_type"))
            length = _header(scope, b"content-length")
            if length is not None and length.strip().isdigit() and \
                    int(length) > self.max_body_bytes:
                return await _send_error(scope, receive, send, _too_large(self.max_body_bytes))
        return await self.app(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server's limit of {limit} bytes "
                    f"(--max-body-mb)", status=413, code="request_too_large")


def create_app(engine: AsyncEngine, model_name: str, *, aliases: tuple[str, ...] = (),
               metrics: Metrics | None = None, shutdown_engine: bool = True,
               drain_timeout: float = 60.0, api_key: str | None = None,
               allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = 30.0,
               parse_workers: int | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None,
               enable_prompt_tokens_details: bool = False,
               trust_request_chat_template: bool = False) -> FastAPI:
    """`model_name`: the id /v1/models lists and responses carry; requests may name it or one
    of `aliases` (or leave `model` out). With `shutdown_engine`, the app's shutdown drains the
    engine: requests in flight finish for up to `drain_timeout` s (0: none), the rest end with
    finish_reason "abort", new ones get 503; `app.state.drain()` starts that drain early (the
    launcher's uvicorn server calls it when shutdown begins, before it waits for connections).
    `api_key`, `allowed_origins`, `allowed_hosts`, `max_body_bytes`, `body_timeout_s`: the
    guards of the module docstring. `tool_call_parser` / `reasoning_parser`: the names of the
    parsers chat outputs are read with (tool_parsers.py, reasoning_parsers.py).
    `enable_prompt_tokens_details`: every usage carries prompt_tokens_details.cached_tokens
    (vLLM's flag; off by default, as cache hits tell one tenant about another's prompts).
    `trust_request_chat_template`: chat requests may bring their own chat_template (vLLM's
    flag; off by default: such a request gets 400)."""
    if drain_timeout is None or drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds, got {drain_timeout}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0 seconds, got {body_timeout_s}")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # an unknown name: ValueError listing the names
    if reasoning_parser is not None:
        reasoning_parser_class(reasoning_parser)
    chat_config = ChatConfig(tool_call_parser, reasoning_parser, trust_request_chat_template)
    if metrics is None:
        metrics = Metrics(model_name)
    if engine.observer is None:
        engine.observer = metrics
    metrics.engine_source = lambda: (engine.snapshot, engine.is_running)
    names = {model_name, *aliases}
    serving = OpenAIServing(engine, model_name, enable_prompt_tokens_details)
    created = int(time.time())
    vocab = engine.model_config.vocab_size
    # one core stays free for the event loop and the engine thread
    pool = concurrent.futures.ThreadPoolExecutor(
        parse_workers or max(1, min(4, (os.cpu_count() or 2) - 1)),
        thread_name_prefix="mambaserve-parse")
    drain_task: list[asyncio.Future] = []

    async def drain() -> bool:
        """Stop taking requests and drain the engine (once; later calls wait for the first).
        Without `shutdown_engine` the engine is someone else's: nothing to do."""
        if not shutdown_engine:
            return True
        if not drain_task:
            logger.info("shutting down: %d request(s) in flight get up to %g s to finish",
                        engine.num_in_flight, drain_timeout)
            drain_task.append(asyncio.ensure_future(
                engine.ashutdown(drain=drain_timeout > 0, timeout=drain_timeout)))
        return await asyncio.shield(drain_task[0])

    @asynccontextmanager
    async def lifespan(app):
        yield
        await drain()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="mambaserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=SafeJSONResponse)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain
    app.state.drain_timeout = drain_timeout
    # added innermost first: metrics (outermost) > host / origin > CORS > API key, type, size
    app.add_middleware(_APIGuard, api_key=api_key or None, max_body_bytes=max_body_bytes)
    if allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(_HostOriginGuard, allowed_hosts=allowed_hosts,
                       allowed_origins=allowed_origins)
    app.add_middleware(_HTTPMetrics, metrics=metrics)

    def check_model(body: dict) -> None:
        name = get_str(body, "model")
        if name is not None and name not in names:
            raise APIError(f"The model `{name}` does not exist. This server serves "
                           f"`{model_name}`.", status=404, param="model",
                           code="model_not_found")

    def parse_body(raw: bytes, parse):
        """JSON -> ParsedRequest, on the parse pool (tokenizing can take a while)."""
        try:
            body = parse_json(raw)
            check_model(body)
            return parse(body, engine.tokenizer, vocab, engine.max_model_len)
        except APIError:
            raise
        except Exception as e:
            logger.warning("unforeseen %s while parsing a request (answered 400): %s",
                           type(e).__name__, e)
            logger.debug("parse error", exc_info=True)
            raise APIError(f"invalid request: {type(e).__name__}: {e}") from None

    async def read_body(request: Request) -> bytes:
        chunks, size = [], 0

        async def read() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise _too_large(max_body_bytes)
                chunks.append(chunk)

        try:
            await asyncio.wait_for(read(), body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(f"the request body was not received within {body_timeout_s:g} s "
                           "(--timeout-body)",
                           status=408, code="request_timeout") from None
        return b"".join(chunks)

    async def handle(request: Request, parse, run):
        try:
            raw = await read_body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        except APIError as e:  # too large (no declared length) / too slow: stop reading it
            return error_response(e, {"Connection": "close"})
        try:
            loop = asyncio.get_running_loop()
            parsed = await loop.run_in_executor(pool, parse_body, raw, parse)
        except APIError as e:
            return error_response(e)
        except RuntimeError as e:  # the pool was shut down: the server is stopping
            return error_response(engine_error(e) if "shutdown" not in str(e) else APIError(
                "the server is shutting down and takes no new requests", status=503,
                type="server_error", code="shutting_down"))
        del raw
        try:
            result = await run(parsed, request.receive)
        except APIError as e:
            return error_response(e)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - never a 500
            return error_response(engine_error(e))
        if isinstance(result, dict):
            return SafeJSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, functools.partial(parse_chat, config=chat_config),
                            serving.chat)

    async def answer(result: dict, receive) -> dict:  # what the parse pool computed
        return result

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize_route(request: Request):
        return await handle(request, functools.partial(tokenize, config=chat_config), answer)

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize_route(request: Request):
        return await handle(request, detokenize, answer)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created,
                "owned_by": "mambaserve", "max_model_len": engine.max_model_len,
                "vocab_size": vocab}

    @app.get("/v1/models")
    async def models():
        return SafeJSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in names:
            return error_response(APIError(f"The model `{model}` does not exist.", status=404,
                                           param="model", code="model_not_found"))
        return SafeJSONResponse(model_card())

    @app.get("/health")
    async def health():
        if engine.is_running:
            return SafeJSONResponse({"status": "ok"})
        return SafeJSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return SafeJSONResponse({"version": __version__})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(APIError(str(exc.detail), status=exc.status_code, code=code),
                              getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(APIError(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(engine_error(exc))

    return app
