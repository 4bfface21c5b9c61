"""uvicorn's HTTP/1.1 protocol with Weir's transport limits: what one connection may hold, and for how long.

- **Send buffers.** A client that stops reading fills its connection's buffers; only then does the server's
  ``send`` block and the client timeout start counting. Small buffers (``SO_SNDBUF`` and the transport's
  high-water mark) make that happen after a few kilobytes instead of megabytes (loopback autotunes kernel
  send buffers to several MiB), so a stalled reader is dropped after about ``client_timeout_s``.
- **Read deadlines.** A request's headers must be complete within ``header_timeout_s`` of the connection
  opening, or of the request's first byte on a reused connection; otherwise the socket is closed without an
  answer. Its body must be complete within ``body_timeout_s`` of the headers; otherwise the client gets a
  408 and the application sees a disconnect. Between requests uvicorn's keep-alive timer closes an idle
  connection.
- **Connection caps.** At most ``max_connections`` connections are served at once, at most
  ``max_connections_per_address`` from one address, and a quarter of the slots are kept for connections
  that carried an authenticated request (``api/connection_slots.py``). One opened beyond a cap is answered
  503 on its first request and closed.
- **Refusals in OpenAI's envelope.** Request headers over ``MAX_HEADER_BYTES`` get a 431, a malformed
  request a 400, both with a JSON ``{"error": {...}}`` body instead of uvicorn's plain text.

After answering a refusal the server shuts its side of the connection and reads and drops what the client
still sends (for at most ``header_timeout_s``): closing with unread data would reset the connection and
could destroy the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from enum import Enum
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from api.connection_slots import AUTHENTICATED, ConnectionSlots
from api.errors import APIError
from api.transport_limits import MAX_HEADER_BYTES, TransportLimits

log = logging.getLogger("weir.api")


class _Phase(Enum):
    HEADERS = "headers"
    BODY = "body"
    LINGER = "linger"


def _error_response(
    status: int, message: str, code: str, error_type: str = "invalid_request_error"
) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """Headers and body of a refusal in OpenAI's envelope that also closes the connection."""
    body = json.dumps(APIError(status, message, type=error_type, code=code).body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    return headers, body


async def _over_capacity(scope: Any, receive: Any, send: Any) -> None:
    """The ASGI app that answers every request on a connection opened beyond the cap."""
    headers, body = _error_response(
        503,
        "The server has too many open connections. Please retry after a short wait.",
        "server_overloaded",
        "server_error",
    )
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class LimitedProtocol(H11Protocol):
    """``H11Protocol`` with read deadlines, a connection cap, small send buffers and enveloped refusals.

    Use a subclass made by ``limited_protocol``: it carries the limits and the server's connection slots.
    """

    limits: ClassVar[TransportLimits]
    send_buffer_bytes: ClassVar[int]
    slots: ClassVar[ConnectionSlots[LimitedProtocol]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: _Phase | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        transport.set_write_buffer_limits(high=self.send_buffer_bytes)
        refusal = self.slots.admit(self, self.client[0] if self.client else "")
        if refusal is None:
            self.app = self._reporting_authentication(self.app)
        else:
            log.warning("%s: %s; refusing it", self._peer(), refusal)
            self.app = _over_capacity
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        if self._phase is _Phase.LINGER:
            return  # the rest of a refused request
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may have started

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._set_deadline(None)
        self.slots.release(self)

    def awaiting_request(self) -> bool:
        """No request of this connection is in the application: it is idle or still sending headers."""
        return self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE

    def evict(self) -> None:
        """Close the connection (waiting for a request) to give its slot to a newer one."""
        log.info("%s: closed, waiting for a request while the slots are full", self._peer())
        self._set_deadline(None)
        self.transport.close()

    def _reporting_authentication(self, app: Any) -> Any:
        """``app`` with a scope extension that moves this connection to the authenticated ones."""

        async def reporting(scope: Any, receive: Any, send: Any) -> None:
            scope.setdefault("extensions", {})[AUTHENTICATED] = lambda: self.slots.authenticated(self)
            await app(scope, receive, send)

        return reporting

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse: the envelope, 431 when the headers are too big."""
        if len(self.conn.trailing_data[0]) > MAX_HEADER_BYTES:
            message = f"The request's headers exceed {MAX_HEADER_BYTES} bytes."
            self._refuse(431, message, "request_headers_too_large")
        else:
            self._refuse(400, "The request is not valid HTTP/1.1.", "invalid_http")

    def _follow_request(self) -> None:
        """Arm the deadline of what the connection waits for: headers, a body, or nothing."""
        if self._phase is not _Phase.LINGER:
            phase = None if self.transport.is_closing() else self._awaited()
            if phase is not self._phase:
                self._set_deadline(phase)

    def _awaited(self) -> _Phase | None:
        """What the client owes: a request's headers (unless uvicorn's keep-alive timer waits for the first
        byte of the next one), the rest of a body, or nothing."""
        state = self.conn.their_state
        if state is h11.IDLE:
            started = bool(self.conn.trailing_data[0])
            return _Phase.HEADERS if started or self.timeout_keep_alive_task is None else None
        return _Phase.BODY if state is h11.SEND_BODY else None

    def _set_deadline(self, phase: _Phase | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is _Phase.HEADERS:
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)
        elif phase is _Phase.BODY:
            self._deadline = self.loop.call_later(self.limits.body_timeout_s, self._body_late)
        elif phase is _Phase.LINGER:
            self._deadline = self.loop.call_later(self.limits.header_timeout_s, self.transport.close)

    def _headers_late(self) -> None:
        started = bool(self.conn.trailing_data[0])
        log.log(
            logging.INFO if started else logging.DEBUG,
            "%s: closed, %s within %gs",
            self._peer(),
            "request headers incomplete" if started else "no request",
            self.limits.header_timeout_s,
        )
        self.transport.close()

    def _body_late(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            log.info("%s: closed, request body incomplete after the response", self._peer())
            self.transport.close()
            return
        log.info("%s: 408, request body incomplete within %gs", self._peer(), self.limits.body_timeout_s)
        cycle.disconnected = True  # the app's receive() now reports a disconnect; its sends go nowhere
        cycle.message_event.set()
        message = f"The request body did not arrive within {self.limits.body_timeout_s:g} seconds."
        self._refuse(408, message, "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer with a refusal, then close once the client has stopped sending (or after a deadline)."""
        headers, body = _error_response(status, message, code)
        events = (
            h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
            h11.Data(data=body),
            h11.EndOfMessage(),
        )
        self.transport.write(b"".join(self.conn.send(event) or b"" for event in events))
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.flow.resume_reading()
        self._set_deadline(_Phase.LINGER)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"


def limited_protocol(limits: TransportLimits, send_buffer_bytes: int) -> type[LimitedProtocol]:
    """A ``LimitedProtocol`` class for one server: ``limits``, send buffers of about ``send_buffer_bytes``."""
    attributes = {"limits": limits, "send_buffer_bytes": send_buffer_bytes, "slots": ConnectionSlots(limits)}
    return type("LimitedProtocol", (LimitedProtocol,), attributes)
