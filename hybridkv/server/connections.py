"""Connection-level limits uvicorn does not have: a header deadline and a connection cap.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but a connection that
opens and then sends its request line and headers one byte at a time, or nothing at all,
stays open for ever (slowloris): 1000 such connections stayed open in the issue #15 test.
:func:`guarded_h11_protocol` makes a subclass of uvicorn's h11 protocol that

- closes a connection whose request headers are not complete ``header_timeout_s`` after
  the connection opened or its previous response finished (answering 408 first);
- answers 503 and closes any connection beyond ``max_connections`` open at once.

Body deadlines are the app's (:class:`hybridkv.server.limits.BodyLimitMiddleware`): the
body arrives through ASGI ``receive``, where a timeout can answer with a proper 408.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("hybridkv.server")


def _raw_response(status: bytes, body: bytes) -> bytes:
    head = f"content-type: text/plain\r\ncontent-length: {len(body)}\r\nconnection: close"
    return b"HTTP/1.1 " + status + b"\r\n" + head.encode() + b"\r\n\r\n" + body


_REFUSE_503 = _raw_response(b"503 Service Unavailable", b"too many open connections")
_TIMEOUT_408 = _raw_response(b"408 Request Timeout", b"request headers took too long")


def guarded_h11_protocol(header_timeout_s: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-header deadline and a cap on open connections.

    Pass the result as ``uvicorn.Config(http=...)``.
    """

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > max_connections:
                logger.warning("refused a connection: %d open already", max_connections)
                transport.write(_REFUSE_503)
                transport.close()
                return
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and not self._waiting_for_headers():
                self._disarm_header_timer()  # the headers of a new request are complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._waiting_for_headers():
                self._arm_header_timer()  # the next request's headers are due in time too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm_header_timer(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()  # type: ignore[union-attr]
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self._waiting_for_headers():  # no request started since the timer began
                self.transport.write(_TIMEOUT_408)
                self.transport.close()

    return GuardedH11Protocol


__all__ = ["guarded_h11_protocol"]
