"""Starting the server: `mambaserve serve` (uvicorn in the main thread, SIGTERM / SIGINT drain
gracefully) and `ServerThread` (uvicorn in a background thread, for tests and embedding)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from mambaserve.config import EngineConfig
from mambaserve.engine.async_engine import AsyncEngine
from mambaserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("mambaserve.server")


def build_app(model: str | Path | None = None, *, served_model_name: str | None = None,
              max_waiting: int | None = 1024, drain_timeout: float = 60.0, **engine_kwargs):
    """Load the model and wrap it: -> (FastAPI app, AsyncEngine). `engine_kwargs` are
    `EngineConfig` fields (dtype, device, max_num_seqs, ...)."""
    from mambaserve.server.app import create_app

    if model is None:
        from mambaserve.default_model import default_model_path

        model = default_model_path()
    unknown = set(engine_kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown engine argument(s): {sorted(unknown)}")
    engine = AsyncEngine(LLMEngine(model, EngineConfig(**engine_kwargs)), max_waiting=max_waiting)
    name = served_model_name or Path(model).name
    app = create_app(engine, name, aliases=(str(model),), drain_timeout=drain_timeout)
    return app, engine


def serve(model: str | Path | None, host: str = "127.0.0.1", port: int = 8000, *,
          served_model_name: str | None = None, max_waiting: int | None = 1024,
          drain_timeout: float = 60.0, log_level: str = "info", **engine_kwargs) -> int:
    """Run the server until SIGTERM / SIGINT; then stop accepting connections, let the
    requests in flight finish (up to `drain_timeout` s) and stop the engine."""
    import uvicorn

    t0 = time.perf_counter()
    app, engine = build_app(model, served_model_name=served_model_name, max_waiting=max_waiting,
                            drain_timeout=drain_timeout, **engine_kwargs)
    mem = engine.memory_report()
    if isinstance(logging.getLevelName(log_level.upper()), int):  # uvicorn also has "trace"
        logging.getLogger("mambaserve").setLevel(log_level.upper())
    logger.info("model loaded in %.1f s: %d state slots, %d KV pages; serving it as %r",
                time.perf_counter() - t0, mem["state_slots"], mem["kv_pages"],
                app.state.metrics.model_name)
    uvicorn.run(app, host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=int(drain_timeout) if drain_timeout else None)
    if engine.is_running:  # the lifespan did not run (startup failed): stop the loop anyway
        engine.shutdown(drain=False)
    return 0


class ServerThread:
    """uvicorn serving `app` from a background thread on a free loopback port:

        with ServerThread(app) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                     lifespan="on", timeout_graceful_shutdown=30)
        self.server = uvicorn.Server(self.config)
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

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
