"""``TransportLimits``: how many HTTP connections (in all, per address, for the unauthenticated), and how
long each may take to send a request.

Enforced by ``api/http_protocol.py`` and ``api/connection_slots.py``; kept apart so that ``weir``'s
argument parser can show the defaults without importing uvicorn.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HEADER_BYTES = 16 * 1024  # the request line and headers; h11's bound on one incomplete event


@dataclass(frozen=True)
class TransportLimits:
    """Bounds on every connection; the defaults are ``weir serve``'s."""

    max_connections: int = 512  # served at once; one more gets a 503 on its first request
    max_connections_per_address: int = 256  # served at once from one client address: half the slots
    header_timeout_s: float = 10.0  # from the connection's opening, or a reused one's first byte of a request
    body_timeout_s: float = 30.0  # from the end of the headers
    keep_alive_timeout_s: float = 5.0  # idle between requests

    @property
    def reserved_connections(self) -> int:
        """Slots only a connection that carried an authenticated request may take (a quarter of them)."""
        return self.max_connections // 4
