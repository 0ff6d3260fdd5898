"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine: `mambaserve serve`.
See docs/server.md. Needs the `server` extra: pip install "mambaserve[server]"."""

from mambaserve.server.app import create_app
from mambaserve.server.launcher import ServerThread, build_app, serve

__all__ = ["ServerThread", "build_app", "create_app", "serve"]
