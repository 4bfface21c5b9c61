"""uvicorn's HTTP/1.1 protocol with small per-connection send buffers.

A client that stops reading fills its connection's buffers; only then does the server's ``send`` block and
the client timeout start counting. Small buffers make that happen after a few kilobytes instead of
megabytes (loopback autotunes kernel send buffers to several MiB), so a stalled reader is noticed and
dropped after about ``client_timeout_s`` rather than never. Token streams are small; throughput is unaffected.
"""

from __future__ import annotations

import asyncio
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol


def bounded_protocol(send_buffer_bytes: int) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass that caps unsent data per connection at about ``send_buffer_bytes``."""

    class BoundedSendProtocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            transport.set_write_buffer_limits(high=send_buffer_bytes)

    return BoundedSendProtocol
