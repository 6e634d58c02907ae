"""BodyLimitMiddleware: a request body over the limit gets a 413 before the app reads it.

A pure ASGI middleware rather than a check in the handlers, because FastAPI parses the
body before any handler runs: the size has to be enforced while the bytes arrive, and a
chunked upload has no Content-Length to check up front.
"""

from __future__ import annotations

import json
from typing import Any

from hybridkv.server.errors import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: far above any prompt max_model_len allows


class BodyLimitMiddleware:
    """Reads the whole body (up to the limit) first, then replays it to the app."""

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._reject(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before the body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._reject(send)
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

    async def _reject(self, send: Any) -> None:
        payload = json.dumps(
            error_body(f"the request body exceeds {self.max_body_bytes} bytes", 413)
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
