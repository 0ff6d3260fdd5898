"""Starting the server: `mambaserve serve` (uvicorn in the main thread, SIGTERM / SIGINT drain
gracefully) and `ServerThread` (uvicorn in a background thread, for tests and embedding).

Both run `Server`, uvicorn's server with two changes:
- shutdown drains the engine first: SIGTERM closes the listening socket, the engine stops taking
  requests and lets those in flight run for up to the app's drain timeout, then ends the rest
  with finish_reason "abort" (streams get a last chunk and [DONE], plain requests a 200 with
  the partial output); uvicorn then waits for those responses to be written (with a margin of
  `SHUTDOWN_MARGIN_S`) before it closes what is left. uvicorn alone would cancel the open
  connections at its own timeout, before the engine had answered them (a 500 per request).
- a connection must send a request's headers within `timeout_header_s` of opening (or of the
  previous response), or it is closed: a silent or half-sent connection holds no descriptor for
  long. Idle keep-alive connections close after `timeout_keep_alive_s` (uvicorn's timer).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mambaserve.config import EngineConfig
from mambaserve.engine.async_engine import AsyncEngine
from mambaserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("mambaserve.server")

SHUTDOWN_MARGIN_S = 10.0  # after the drain, for the aborted requests' answers to be written
DEFAULT_TIMEOUT_KEEP_ALIVE_S = 5.0
DEFAULT_TIMEOUT_HEADER_S = 10.0


def build_app(model: str | Path | None = None, *, served_model_name: str | None = None,
              max_waiting: int | None = 1024, drain_timeout: float = 60.0,
              api_key: str | None = None, allowed_origins: Sequence[str] = (),
              allowed_hosts: Sequence[str] | None = None, max_body_bytes: int | None = None,
              timeout_body_s: float = 30.0, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, enable_prompt_tokens_details: bool = False,
              trust_request_chat_template: bool = False, **engine_kwargs):
    """Load the model and wrap it: -> (FastAPI app, AsyncEngine). `engine_kwargs` are
    `EngineConfig` fields (dtype, device, max_num_seqs, ...); the other arguments are
    `create_app`'s."""
    from mambaserve.server.app import DEFAULT_MAX_BODY_BYTES, create_app

    if model is None:
        from mambaserve.default_model import default_model_path

        model = default_model_path()
    unknown = set(engine_kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
    if drain_timeout is None or drain_timeout < 0:
        raise ValueError(f"the drain timeout must be >= 0 seconds, got {drain_timeout}")
    engine = AsyncEngine(LLMEngine(model, EngineConfig(**engine_kwargs)), max_waiting=max_waiting)
    name = served_model_name or Path(model).name
    try:
        app = create_app(engine, name, aliases=(str(model),), drain_timeout=drain_timeout,
                         api_key=api_key, allowed_origins=allowed_origins,
                         allowed_hosts=allowed_hosts,
                         max_body_bytes=max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                         body_timeout_s=timeout_body_s, tool_call_parser=tool_call_parser,
                         reasoning_parser=reasoning_parser,
                         enable_prompt_tokens_details=enable_prompt_tokens_details,
                         trust_request_chat_template=trust_request_chat_template)
    except Exception:
        engine.shutdown(drain=False)
        raise
    return app, engine


def _h11_protocol():
    """uvicorn's h11 protocol with a deadline for a request's headers."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        def __init__(self, config, *args, **kwargs) -> None:
            super().__init__(config, *args, **kwargs)
            self.timeout_header = getattr(config, "mambaserve_timeout_header_s",
                                          DEFAULT_TIMEOUT_HEADER_S)
            self._header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(self.timeout_header, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and (self.cycle is None
                                                    or self.cycle.response_complete):
                if self.conn.our_state is h11.IDLE or self.conn.our_state is h11.DONE:
                    try:
                        self.conn.send(h11.ConnectionClosed())
                    except h11.LocalProtocolError:
                        pass
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers arrived
                self._disarm()

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse: OpenAI's error body instead of uvicorn's text."""
            body = json.dumps({"error": {"message": "invalid HTTP request: it could not be "
                                         "parsed as HTTP/1.1", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_http"}}).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                for event in (h11.Response(status_code=400, headers=headers,
                                           reason=b"Bad Request"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # a response was already under way
                pass
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is not None \
                    and self.cycle.response_complete:
                self._arm()  # waiting for the next request's headers

    return HeaderTimeoutH11


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn.Server whose shutdown drains the engine before waiting for connections."""

        async def shutdown(self, sockets=None) -> None:
            drain = getattr(getattr(self.config.app, "state", None), "drain", None)
            task = asyncio.ensure_future(drain()) if drain is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if task is not None:
                    await task

    return Server


def make_server(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                timeout_header_s: float = DEFAULT_TIMEOUT_HEADER_S):
    """A uvicorn server for `app` with the drain-first shutdown and the header timeout."""
    import uvicorn

    drain_timeout = getattr(getattr(app, "state", None), "drain_timeout", 60.0)

    for name, v in (("keep-alive timeout", timeout_keep_alive_s),
                    ("header timeout", timeout_header_s)):
        if not v > 0:
            raise ValueError(f"the {name} must be > 0 seconds, got {v}")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            http=_h11_protocol(), timeout_keep_alive=timeout_keep_alive_s,
                            timeout_graceful_shutdown=drain_timeout + SHUTDOWN_MARGIN_S)
    config.mambaserve_timeout_header_s = timeout_header_s
    return _server_class()(config)


def serve(model: str | Path | None, host: str = "127.0.0.1", port: int = 8000, *,
          served_model_name: str | None = None, max_waiting: int | None = 1024,
          drain_timeout: float = 60.0, log_level: str = "info", api_key: str | None = None,
          allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
          max_body_bytes: int | None = None,
          timeout_keep_alive_s: float = DEFAULT_TIMEOUT_KEEP_ALIVE_S,
          timeout_header_s: float = DEFAULT_TIMEOUT_HEADER_S, timeout_body_s: float = 30.0,
          tool_call_parser: str | None = None, reasoning_parser: str | None = None,
          enable_prompt_tokens_details: bool = False, trust_request_chat_template: bool = False,
          **engine_kwargs) -> int:
    """Run the server until SIGTERM / SIGINT; then stop accepting connections, let the
    requests in flight finish (up to `drain_timeout` s, 0: none), end the rest with
    finish_reason "abort" and stop the engine."""
    t0 = time.perf_counter()
    app, engine = build_app(model, served_model_name=served_model_name, max_waiting=max_waiting,
                            drain_timeout=drain_timeout, api_key=api_key,
                            allowed_origins=allowed_origins, allowed_hosts=allowed_hosts,
                            max_body_bytes=max_body_bytes, timeout_body_s=timeout_body_s,
                            tool_call_parser=tool_call_parser,
                            reasoning_parser=reasoning_parser,
                            enable_prompt_tokens_details=enable_prompt_tokens_details,
                            trust_request_chat_template=trust_request_chat_template,
                            **engine_kwargs)
    try:
        server = make_server(app, host, port, log_level=log_level,
                             timeout_keep_alive_s=timeout_keep_alive_s,
                             timeout_header_s=timeout_header_s)
    except Exception:
        engine.shutdown(drain=False)
        raise
    mem = engine.memory_report()
    if isinstance(logging.getLevelName(log_level.upper()), int):  # uvicorn also has "trace"
        logging.getLogger("mambaserve").setLevel(log_level.upper())
    logger.info("model loaded in %.1f s: %d state slots, %d KV pages; serving it as %r",
                time.perf_counter() - t0, mem["state_slots"], mem["kv_pages"],
                app.state.metrics.model_name)
    if not api_key and not _is_loopback_host(host):
        logger.warning("serving on %s without an API key: anyone who can reach this address "
                       "can use the model (set --api-key or MAMBASERVE_API_KEY)", host)
    server.run()
    if engine.is_running:  # the lifespan did not run (startup failed): stop the loop anyway
        engine.shutdown(drain=False)
    return 0


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerThread:
    """uvicorn serving `app` from a background thread on a free loopback port:

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")

    `stop()` shuts down as SIGTERM does (drain first, for the app's drain timeout)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", **timeouts) -> None:
        self.server = make_server(app, host, port, log_level=log_level, **timeouts)
        self.config = self.server.config
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Shut down as SIGTERM does; waits up to `timeout` s (default: the drain timeout and
        the shutdown margin, plus 5 s)."""
        self.server.should_exit = True
        if timeout is None:
            timeout = self.config.timeout_graceful_shutdown + 5.0
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
