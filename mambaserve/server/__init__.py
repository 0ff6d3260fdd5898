"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine: `mambaserve serve`.
See docs/server.md.

The web stack is imported on first use of `create_app` / `serve` / `ServerThread` / `build_app`,
so the pure modules here (tool and reasoning parsers the CLI lists) import without it."""

from __future__ import annotations

import importlib

_EXPORTS = {"create_app": "mambaserve.server.app", "ServerThread": "mambaserve.server.launcher",
            "build_app": "mambaserve.server.launcher", "serve": "mambaserve.server.launcher"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
