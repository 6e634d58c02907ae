"""BodyLimitMiddleware at the ASGI level: a rejected body is read to its end (bounded)
before the 413 goes out, so closing the connection cannot reset it away.

Regression: `test_oversized_body_is_413` failed once in CI with the client unable to read
the 413 (the server answered on Content-Length and closed with 5 MiB unread: TCP reset).
"""

from __future__ import annotations

import asyncio
from typing import Any

from hybridkv.server.limits import DRAIN_FACTOR, BodyLimitMiddleware

LIMIT = 1000
CHUNK = 400


class Channel:
    """A client that uploads ``num_chunks`` pieces (or forever) and records the order of
    what the server reads and sends."""

    def __init__(self, num_chunks: int | None) -> None:
        self.num_chunks = num_chunks
        self.events: list[str] = []
        self.sent: list[dict[str, Any]] = []
        self.read = 0

    async def receive(self) -> dict[str, Any]:
        self.read += 1
        self.events.append("receive")
        more = self.num_chunks is None or self.read < self.num_chunks
        return {"type": "http.request", "body": b"x" * CHUNK, "more_body": more}

    async def send(self, message: dict[str, Any]) -> None:
        self.events.append(message["type"])
        self.sent.append(message)


async def never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("an oversized body must not reach the app")


def run(channel: Channel, declared: int | None) -> None:
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "headers": headers}
    middleware = BodyLimitMiddleware(never_called, max_body_bytes=LIMIT, body_timeout_s=5.0)
    asyncio.run(middleware(scope, channel.receive, channel.send))


def test_declared_oversize_body_is_read_to_its_end_before_the_413() -> None:
    channel = Channel(num_chunks=5)  # 2,000 bytes > 1,000
    run(channel, declared=5 * CHUNK)
    assert channel.read == 5
    assert channel.events[:6] == ["receive"] * 5 + ["http.response.start"]
    assert channel.sent[0]["status"] == 413


def test_chunked_oversize_body_is_read_to_its_end_before_the_413() -> None:
    channel = Channel(num_chunks=6)  # no Content-Length: over the limit at the 3rd piece
    run(channel, declared=None)
    assert channel.read == 6
    assert channel.sent[0]["status"] == 413


def test_a_flood_is_not_read_past_the_drain_bound() -> None:
    channel = Channel(num_chunks=None)  # never ends
    run(channel, declared=10**9)
    assert channel.read * CHUNK <= DRAIN_FACTOR * LIMIT + 2 * CHUNK
    assert channel.sent[0]["status"] == 413
