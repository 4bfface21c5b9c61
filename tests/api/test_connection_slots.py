"""``ConnectionSlots`` on its own: which connection gets a slot, which gives its slot up, which is refused.

The connections here are plain objects that say whether they wait for a request; the real protocol is
driven over sockets in ``test_transport_limits.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.connection_slots import AUTHENTICATED, ConnectionSlots, mark_authenticated
from api.transport_limits import TransportLimits


@dataclass(eq=False)
class _Connection:
    waiting: bool = True  # no request of it is in the application
    evicted: bool = False

    def awaiting_request(self) -> bool:
        return self.waiting

    def evict(self) -> None:
        self.evicted = True


def _slots(total: int = 8, per_address: int = 8) -> ConnectionSlots[_Connection]:
    return ConnectionSlots(TransportLimits(max_connections=total, max_connections_per_address=per_address))


def test_one_address_is_capped_and_a_released_slot_is_reused() -> None:
    slots = _slots(per_address=2)
    first, second = _Connection(), _Connection()
    assert slots.admit(first, "10.0.0.1") is None and slots.admit(second, "10.0.0.1") is None
    assert "over 2 connections from 10.0.0.1" in slots.admit(_Connection(), "10.0.0.1")
    assert slots.admit(_Connection(), "10.0.0.2") is None
    slots.release(first)
    slots.release(first)  # closed twice (evicted, then lost): counted once
    assert slots.admit(_Connection(), "10.0.0.1") is None and len(slots) == 3


def test_unauthenticated_connections_hold_three_quarters_and_the_oldest_waiting_gives_way() -> None:
    slots = _slots()  # 8 slots, 2 kept for authenticated connections
    busy = _Connection(waiting=False)  # its request is in the application
    unproven = [busy] + [_Connection() for _ in range(5)]
    for i, connection in enumerate(unproven):
        assert slots.admit(connection, f"10.0.0.{i}") is None
    newcomer = _Connection()
    assert slots.admit(newcomer, "10.0.1.1") is None
    assert [c.evicted for c in unproven] == [False, True, False, False, False, False]
    assert len(slots) == 6

    slots.authenticated(newcomer)
    authenticated = [newcomer]
    for i in range(2):  # authenticated connections fill the kept slots, evicting nobody
        authenticated.append(_Connection())
        assert slots.admit(authenticated[-1], f"10.0.2.{i}") is None
        slots.authenticated(authenticated[-1])
    assert len(slots) == 8 and sum(c.evicted for c in unproven) == 1

    for connection in unproven[2:]:  # every unauthenticated connection has a request in the application
        connection.waiting = False
    refused = slots.admit(_Connection(), "10.0.3.1")
    assert refused is not None and "unauthenticated and busy" in refused
    assert not any(c.evicted for c in authenticated)


def test_the_scope_extension_reports_authentication() -> None:
    calls: list[str] = []
    mark_authenticated({"extensions": {AUTHENTICATED: lambda: calls.append("yes")}})
    mark_authenticated({"type": "http"})  # a server without slots: nothing to report to
    assert calls == ["yes"]
