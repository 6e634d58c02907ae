"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine.

Modules, one job each: ``protocol`` (request and response bodies), ``errors`` (OpenAI's
error shape for every failure), ``limits`` (body size), ``async_engine`` (the step thread
and per-request queues), ``serving`` (what both endpoints share), ``completions`` and
``chat`` (the two endpoints), ``metrics`` (Prometheus), ``app`` (routes, auth, lifespan).
"""

from hybridkv.server.app import create_app
from hybridkv.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app"]
