"""BodyLimitMiddleware: a request body over the size limit gets a 413, one that has not
fully arrived by the deadline a 408, before the app reads it.

A pure ASGI middleware rather than a check in the handlers, because FastAPI parses the
body before any handler runs: the size has to be enforced while the bytes arrive, and a
chunked upload has no Content-Length to check up front. The deadline is for the whole
body, not per piece, so a client dripping a byte now and then cannot hold a connection
and up to ``max_body_bytes`` of memory for ever.

A rejected body is drained (read and dropped, up to ``DRAIN_FACTOR`` times the limit and
within the deadline) before the 413 is sent: a client uploads the whole body before it
reads the answer, and a connection closed with unread bytes in the server's socket is
reset by TCP, which can destroy the 413 on its way (tests/server saw the client fail
reading it once in CI). Past the drain bound the 413 is sent at once (a flood is not
read to its end).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hybridkv.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt max_model_len allows
DEFAULT_BODY_TIMEOUT_S = 30.0
DRAIN_FACTOR = 4  # a rejected body is read and dropped up to this many times the limit


class BodyLimitMiddleware:
    """Reads the whole body (up to the limit) first, then replays it to the app."""

    def __init__(
        self,
        app: Any,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        too_large = f"the request body exceeds {self.max_body_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._drain(receive, 0, deadline)
            await self._reject(send, 413, too_large)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await _receive_by(receive, deadline)
            if message is None:
                await self._reject(
                    send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s"
                )
                return
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, size, deadline)
                await self._reject(send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the real channel: it reports the disconnect

        await self.app(scope, replay, send)

    async def _drain(self, receive: Any, size: int, deadline: float) -> None:
        """Read and drop the rest of a rejected body: until it ends, the client leaves, the
        deadline passes or ``size`` (bytes read so far) reaches the drain bound."""
        while size <= DRAIN_FACTOR * self.max_body_bytes:
            message = await _receive_by(receive, deadline)
            if message is None or message["type"] == "http.disconnect":
                return
            if not message.get("more_body", False):
                return
            size += len(message.get("body", b""))

    async def _reject(self, send: Any, status: int, message: str) -> None:
        payload = json.dumps(error_body(message, status)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


async def _receive_by(receive: Any, deadline: float) -> Any:
    """The next ASGI message, or None once the loop's clock has passed ``deadline``."""
    remaining = max(0.0, deadline - asyncio.get_running_loop().time())
    try:
        return await asyncio.wait_for(receive(), remaining)
    except TimeoutError:
        return None
