"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine.

Modules, one job each: ``config`` (the server's options, torch-free: the CLI builds its
flags from it), ``protocol`` (request and response bodies), ``errors`` (OpenAI's error
shape for every failure), ``limits`` (body size and time), ``connections`` (header and
idle timeouts, the connection cap), ``async_engine`` (the step thread and per-request
queues), ``serving`` (what both endpoints share), ``completions`` and ``chat`` (the two
endpoints), ``metrics`` (Prometheus), ``app`` (routes, auth, lifespan).

The names below load on first use, so that reading ``config`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "AsyncEngine": "hybridkv.server.async_engine",
    "ServerConfig": "hybridkv.server.config",
    "create_app": "hybridkv.server.app",
}

__all__ = ["AsyncEngine", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'hybridkv.server' has no attribute {name!r}")
