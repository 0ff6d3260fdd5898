"""The FastAPI application: OpenAI-compatible routes over one AsyncEngine.

Every route catches everything at its boundary: a client error is a 4xx with OpenAI's error
body, the engine's own trouble a 503, and no request ever gets a 500.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mambaserve import __version__
from mambaserve.engine.async_engine import AsyncEngine
from mambaserve.server.metrics import Metrics
from mambaserve.server.protocol import APIError, get_str, parse_chat, parse_completion, parse_json
from mambaserve.server.serving import ClientDisconnected, OpenAIServing, engine_error

logger = logging.getLogger("mambaserve.server")

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
          "/version")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


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


def create_app(engine: AsyncEngine, model_name: str, *, aliases: tuple[str, ...] = (),
               metrics: Metrics | None = None, shutdown_engine: bool = True,
               drain_timeout: float = 60.0) -> FastAPI:
    """`model_name`: the id /v1/models lists and responses carry; requests may name it or one
    of `aliases` (or leave `model` out). With `shutdown_engine`, the app's shutdown (uvicorn's,
    on SIGTERM / SIGINT) drains the engine: requests in flight finish, new ones get 503."""
    if metrics is None:
        metrics = Metrics(model_name)
    if engine.observer is None:
        engine.observer = metrics
    names = {model_name, *aliases}
    serving = OpenAIServing(engine, model_name)
    created = int(time.time())
    vocab = engine.model_config.vocab_size

    @asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            logger.info("shutting down: draining %d request(s)", engine.num_in_flight)
            await engine.ashutdown(drain=True, timeout=drain_timeout)

    app = FastAPI(title="mambaserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(_HTTPMetrics, metrics=metrics)

    def check_model(body: dict) -> None:
        name = get_str(body, "model")
        if name is not None and name not in names:
            raise APIError(f"The model `{name}` does not exist. This server serves "
                           f"`{model_name}`.", status=404, param="model",
                           code="model_not_found")

    async def handle(request: Request, parse, run):
        try:
            raw = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)
        try:
            body = parse_json(raw)
            check_model(body)
            parsed = parse(body, engine.tokenizer, vocab, engine.max_model_len)
        except APIError as e:
            return error_response(e)
        except Exception as e:  # a request our parser did not foresee: still the client's
            logger.exception("unexpected error while parsing a request")
            return error_response(APIError(f"invalid request: {type(e).__name__}: {e}"))
        try:
            result = await run(parsed, request.receive)
        except APIError as e:
            return error_response(e)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - never a 500
            return error_response(engine_error(e))
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, parse_chat, serving.chat)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created,
                "owned_by": "mambaserve", "max_model_len": engine.max_model_len,
                "vocab_size": vocab}

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model not in names:
            return error_response(APIError(f"The model `{model}` does not exist.", status=404,
                                           param="model", code="model_not_found"))
        return JSONResponse(model_card())

    @app.get("/health")
    async def health():
        if engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics_route():
        return PlainTextResponse(metrics.render(engine.snapshot, engine.is_running),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        return JSONResponse({"version": __version__})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(APIError(str(exc.detail), status=exc.status_code, code=code).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return error_response(APIError(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def any_error(request: Request, exc: Exception):
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(engine_error(exc))

    return app
