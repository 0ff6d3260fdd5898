"""A real server (uvicorn in a background thread, on a free loopback port) over the tiny
checkpoint, shared by the server tests."""

from __future__ import annotations

import time

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes several seconds (subprocess, many requests)")


class Served:
    def __init__(self, app, engine, thread) -> None:
        self.app, self.engine, self.thread = app, engine, thread
        self.url = thread.url
        self.base_url = thread.url + "/v1"
        self.model = app.state.metrics.model_name

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kw)

    def pools(self) -> dict:
        """Running / waiting sequences and free slots / pages, read on the engine thread."""
        def read(e):
            return {"running": e.num_running, "waiting": e.num_waiting,
                    "free_slots": e.state_pool.num_free, "slots": e.state_pool.num_slots,
                    "free_pages": e.kv_pool.num_free, "pages": e.kv_pool.num_pages,
                    "requests": len(e.requests)}
        return self.engine.call_sync(read)

    def wait_idle(self, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            p = self.pools()
            idle = (p["running"] == 0 and p["waiting"] == 0 and p["requests"] == 0
                    and p["free_slots"] == p["slots"] and p["free_pages"] == p["pages"])
            if idle or time.monotonic() > deadline:
                return p
            time.sleep(0.05)


def start_server(ckpt, **kw) -> Served:
    for mod in ("fastapi", "uvicorn", "httpx", "openai"):
        pytest.importorskip(mod)
    from mambaserve.server import ServerThread, build_app

    kw.setdefault("device", "cpu")
    app, engine = build_app(ckpt, **kw)
    thread = ServerThread(app).start()
    return Served(app, engine, thread)


def module_server(**kw):
    """A module-scoped fixture: a server on the tiny checkpoint started with `kw` (the
    options a test module is about), stopped after the module."""
    @pytest.fixture(scope="module")
    def served(tiny_ckpt):
        s = start_server(tiny_ckpt, **kw)
        yield s
        s.thread.stop()
    return served


@pytest.fixture(scope="session")
def server(tiny_ckpt):
    """The shared server: 16 sequences at once, so 64 concurrent requests queue."""
    s = start_server(tiny_ckpt, max_num_seqs=16, max_waiting=None, memory_budget_bytes=64 << 20)
    yield s
    s.thread.stop()


@pytest.fixture(scope="session")
def offline(tiny_ckpt):
    from mambaserve import LLM

    return LLM(tiny_ckpt, memory_budget_bytes=64 << 20)
