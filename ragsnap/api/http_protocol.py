"""uvicorn's HTTP/1.1 protocol with a deadline for the request head and a bound on open
connections.

uvicorn bounds a body's wait (our :class:`~ragsnap.api.middleware.GuardMiddleware`: 408)
and the idle time between keep-alive requests, but not the time a client takes to send
its request line and headers: a client that trickles them holds a connection, and a
file descriptor, for ever (thousands of them starved ``/healthz``). Here every request
head must be complete within ``header_timeout_s`` of its first byte (or of the
connection), else the connection is answered 408 and closed; and a connection over
``max_connections`` is answered 503 and closed at once instead of waiting its turn.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def _closing_response(status: bytes, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"connection: close\r\ncontent-length: " + str(len(text)).encode() + b"\r\n\r\n" + text
    )


TIMEOUT_RESPONSE = _closing_response(
    b"408 Request Timeout", b"request headers not received in time"
)
BUSY_RESPONSE = _closing_response(b"503 Service Unavailable", b"too many open connections")


def guarded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """An :class:`H11Protocol` class with these limits (uvicorn's ``http=`` takes a class)."""

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(BUSY_RESPONSE)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._reading_head() and not self.transport.is_closing():
                self._arm()  # a head is on its way: its deadline runs from its first byte
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._disarm()  # the keep-alive timeout takes over until the next head starts

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _reading_head(self) -> bool:
            """No complete request head yet (h11 leaves IDLE once it has parsed one)."""
            return self.conn.their_state is h11.IDLE

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _timed_out(self) -> None:
            self._head_timer = None
            if self._reading_head() and not self.transport.is_closing():
                self._refuse(TIMEOUT_RESPONSE)

        def _refuse(self, response: bytes) -> None:
            self._disarm()
            self.transport.write(response)
            self.transport.close()

    return GuardedH11Protocol


def server_options(settings: Any) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for ``settings``' connection limits."""
    return {
        "http": guarded_protocol(settings.header_timeout_s, settings.max_connections),
        "timeout_keep_alive": settings.idle_timeout_s,
    }
