"""``ConnectionSlots``: which connections a server serves, so that no one address, and no crowd of
connections that never authenticated, can take every slot.

- At most ``max_connections`` connections at once, and at most ``max_connections_per_address`` from one
  client address.
- A connection that has not yet carried a request that passed API-key authentication ("unproven") may hold
  one of the ``max_connections - reserved_connections`` open slots only; the rest are kept for connections
  that did authenticate. When the open slots are full, a newcomer takes the slot of the oldest unproven
  connection that waits for a request (idle, or still sending headers): closed, as its header deadline
  would close it later. Only if every unproven connection has a request in the application is the newcomer
  refused.

The application reports authentication through the ASGI scope: ``mark_authenticated(scope)``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

from api.transport_limits import TransportLimits

AUTHENTICATED = "weir.authenticated"  # a scope extension: called once the request passed authentication


class Connection(Protocol):
    def awaiting_request(self) -> bool:
        """No request of the connection is in the application (it is idle or still sending headers)."""

    def evict(self) -> None:
        """Close the connection to free its slot."""


C = TypeVar("C", bound=Connection)


def mark_authenticated(scope: Mapping[str, Any]) -> None:
    """Tell the connection that carries this request that it passed authentication."""
    callback = (scope.get("extensions") or {}).get(AUTHENTICATED)
    if callback is not None:
        callback()


class ConnectionSlots(Generic[C]):
    """The connections one server serves, by address and by whether they authenticated."""

    def __init__(self, limits: TransportLimits) -> None:
        self._limits = limits
        self._unproven: dict[C, None] = {}  # in the order they opened: the oldest waiting one is evicted
        self._addresses: dict[C, str] = {}  # every connection served
        self._per_address: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._addresses)

    def admit(self, connection: C, address: str) -> str | None:
        """Give ``connection`` from ``address`` a slot; None when admitted, else why it is refused."""
        limits = self._limits
        if self._per_address[address] >= limits.max_connections_per_address:
            return f"over {limits.max_connections_per_address} connections from {address}"
        open_slots = limits.max_connections - limits.reserved_connections
        if len(self._unproven) >= open_slots or len(self) >= limits.max_connections:
            waiting = next((c for c in self._unproven if c.awaiting_request()), None)
            if waiting is None:
                return f"{len(self)} connections, {len(self._unproven)} of them unauthenticated and busy"
            self.release(waiting)
            waiting.evict()
        self._unproven[connection] = None
        self._addresses[connection] = address
        self._per_address[address] += 1
        return None

    def authenticated(self, connection: C) -> None:
        """``connection`` carried an authenticated request: from now on it may hold a reserved slot."""
        self._unproven.pop(connection, None)

    def release(self, connection: C) -> None:
        """Free the slot of ``connection`` (closed); a connection without one is ignored."""
        address = self._addresses.pop(connection, None)
        if address is None:
            return
        self._unproven.pop(connection, None)
        self._per_address[address] -= 1
        if not self._per_address[address]:
            del self._per_address[address]
