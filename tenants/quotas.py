"""Cost reservations against per-minute rate, concurrency and monthly budget, safe across processes.

Design: per-process leases of budget slices. The tenant's row in ``quota_state`` is the single source of
truth (token bucket refilled continuously at ``cost_per_minute / 60`` per second up to one minute's worth,
in-flight slots, the month's spend). A process takes a *slice* from it in one database round trip
(``weir_quota_acquire``): cost debited from the bucket *and* the month's budget, plus concurrency slots,
recorded on the process's lease row. Reservations are then carved from the local slice in memory;
``settle`` puts the unused part back into the slice. A sync task gives back what the process did not use
in the last interval, reports the settled cost and renews the lease, in one round trip for all tenants
(``weir_quota_return``). A process that dies stops renewing; after ``lease_s`` its whole lease (free
slice and in-flight reservations) is reclaimed by the next acquire for that tenant.

Slices are sized from recent demand: a process keeps free about ``HORIZON_S`` (1 s) of the worst-case
cost it reserved recently, and free slots up to its recent peak of requests in flight; one grant adds at
most a tenth of what remains of each limit beyond what the request needs, so slices shrink as a limit
nears. When a slice falls below half of that, a background acquire tops it up, so a reservation waits on
the database only when the slice is empty (a cold tenant, or a burst); each sync gives back the surplus.

Bounds:

- No overspend: every grant is first taken from the tenant's row under its row lock, so any number of
  processes together never reserve more than the allowance.
- The price is that a slice held by one process is not available to another: a request may be refused
  (even for the budget) while other processes hold unused slices. Each holds at most what it reserved
  in the last ~1 s, taken in grants of at most a tenth of what remained; once its demand stops, the
  smoothed demand halves every sync interval, so the slice goes back within a few intervals (~0.3 s).
- A dead process: after ``lease_s`` (10 s) its lease (free slice and in-flight reservations) is given
  back; settled cost it had not yet reported (at most one sync interval's worth) is given back with it.
  A live process cut off from the database for longer than ``lease_s`` is treated the same way, and
  may then grant once more what it still holds locally.
- Quota statements commit asynchronously (``synchronous_commit = off``; the ledger commits durably). If
  PostgreSQL itself crashes (a clean stop loses nothing), grants of its last ~0.6 s may be forgotten
  while processes still hold them, and up to those slices can be granted once more: with the case above,
  the only ways the limits can be exceeded, by at most the slices held at that moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tenants.records import NotFound

log = logging.getLogger(__name__)

RefusalReason = Literal["rate", "concurrency", "budget"]

ACQUIRE_SQL = sa.text(
    "SELECT * FROM weir_quota_acquire(:tenant, :holder, :cost, :need_cost, :need_slots, :extra_cost, "
    ":extra_slots, :consumed, :lease_s)"
)
RETURN_SQL = sa.text(
    "SELECT weir_quota_return(:holder, CAST(:tenants AS bigint[]), CAST(:cost AS double precision[]), "
    "CAST(:slots AS integer[]), CAST(:consumed AS double precision[]), :lease_s, :close)"
)
_EPSILON = 1e-9
HORIZON_S = 1.0  # seconds of recent demand a slice is sized for
_MAX_TOP_UPS = 4  # background acquires in flight at once
_TOP_UP_AT = 0.5  # a background acquire starts when the free slice falls below this share of its size


def quota_engine(engine: AsyncEngine, pool_size: int = 8) -> AsyncEngine:
    """A small engine of its own for quota calls on ``engine``'s database: each call is one autocommit
    statement (no BEGIN/COMMIT, no ping, no reset), with a fixed pool (opening a connection costs more than
    waiting for one), and commits that skip the wait for the WAL flush, since quota state is soft (module
    docstring)."""
    return create_async_engine(
        engine.url,
        isolation_level="AUTOCOMMIT",
        pool_pre_ping=False,
        pool_reset_on_return=None,
        pool_size=pool_size,
        max_overflow=0,
        connect_args={"timeout": 10, "server_settings": {"synchronous_commit": "off"}},
    )


def _check_cost(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")


@dataclass
class Reservation:
    """Cost and one concurrency slot held for a request until :meth:`QuotaManager.settle`/``release``."""

    tenant_id: int
    cost: float
    id: int
    settled: bool = False


@dataclass(frozen=True)
class Refusal:
    """Why a reservation was refused. ``retry_after_s`` is ``None`` when retrying cannot help (an exhausted
    monthly budget, or a request larger than a minute's allowance); ``reset_s`` is when the limit fully
    resets (bucket full again, or the next month), ``None`` for concurrency."""

    reason: RefusalReason
    limit: float
    remaining: float
    retry_after_s: float | None
    reset_s: float | None

    @property
    def retryable(self) -> bool:
        return self.retry_after_s is not None


@dataclass
class _Slice:
    """What this process holds for one tenant, and its recent demand."""

    cost: float = 0.0  # free cost units
    slots: int = 0  # free concurrency slots
    consumed: float = 0.0  # settled cost not yet reported to the database
    in_flight: int = 0  # unsettled reservations
    reserved_cost: float = 0.0  # worst-case cost reserved since the last sync
    peak_in_flight: int = 0  # most reservations out at once since the last sync
    demand_cost: float = 0.0  # smoothed worst-case cost reserved per sync interval
    peak_slots: int = 0  # peak_in_flight of the last interval
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dry_until: float = 0.0  # no background top-up before this (monotonic), after one got nothing
    topping_up: bool = False

    def take(self, cost: float) -> bool:
        if self.cost + _EPSILON < cost or self.slots < 1:
            return False
        self.cost -= cost
        self.slots -= 1
        self.in_flight += 1
        self.reserved_cost += cost
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return True

    def keep(self, intervals: float) -> tuple[float, int]:
        """What to hold free: ``intervals`` sync intervals of recent cost demand, slots up to the recent
        peak."""
        cost = max(self.demand_cost, self.reserved_cost) * intervals
        slots = max(self.peak_slots, self.peak_in_flight) - self.in_flight
        return cost, max(0, slots)

    def end_interval(self) -> None:
        self.demand_cost = 0.5 * self.demand_cost + 0.5 * self.reserved_cost
        self.peak_slots = self.peak_in_flight
        self.reserved_cost = 0.0
        self.peak_in_flight = self.in_flight


class QuotaManager:
    """One per process (or per event loop): ``reserve`` / ``settle`` / ``release`` and a sync task."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_s: float = 10.0,
        sync_interval_s: float = 0.05,
        holder: str | None = None,
    ) -> None:
        if lease_s <= 0 or sync_interval_s <= 0 or sync_interval_s * 4 > lease_s:
            raise ValueError("need lease_s > 0 and 0 < sync_interval_s <= lease_s / 4")
        self._engine = quota_engine(engine)
        self.lease_s = lease_s
        self.sync_interval_s = sync_interval_s
        self.holder = holder or uuid.uuid4().hex
        self._slices: dict[int, _Slice] = {}
        self._ids = itertools.count(1)
        self._sync_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._horizon = HORIZON_S / sync_interval_s
        self._top_ups = asyncio.Semaphore(_MAX_TOP_UPS)  # leave connections for reservations that wait
        self._sync_lock = asyncio.Lock()
        self._last_renewal = time.monotonic()
        self._closed = False
        self.round_trips = 0  # database round trips made (acquires and syncs), for monitoring
        self.waits = 0  # reservations that waited for a database round trip (empty slice)

    async def reserve(self, tenant_id: int, worst_case_cost: float) -> Reservation | Refusal:
        """Reserve ``worst_case_cost`` and one concurrency slot for ``tenant_id``, or say which limit refuses.

        Raises :class:`~tenants.records.NotFound` for an unknown tenant, ``ValueError`` for a bad cost and
        SQLAlchemy's errors when the database is unreachable and the local slice does not cover the request.
        """
        if self._closed:
            raise RuntimeError("the quota manager is closed")
        _check_cost("worst-case cost", worst_case_cost)
        self._ensure_sync_task()
        piece = self._slices.get(tenant_id)
        if piece is None:
            piece = self._slices[tenant_id] = _Slice()
        if piece.take(worst_case_cost):
            self._maybe_top_up(tenant_id, piece)
            return Reservation(tenant_id, float(worst_case_cost), next(self._ids))
        self.waits += 1
        async with piece.lock:
            while not piece.take(worst_case_cost):
                refusal = await self._acquire(tenant_id, piece, worst_case_cost)
                if refusal is not None:
                    return refusal
        return Reservation(tenant_id, float(worst_case_cost), next(self._ids))

    def _maybe_top_up(self, tenant_id: int, piece: _Slice) -> None:
        """Refill a slice in the background before it runs dry: reservations rarely wait on the database."""
        keep_cost, _ = piece.keep(self._horizon)
        if piece.topping_up or piece.lock.locked() or piece.cost >= _TOP_UP_AT * keep_cost:
            return
        if time.monotonic() < piece.dry_until:
            return
        piece.topping_up = True
        task = asyncio.get_running_loop().create_task(self._top_up(tenant_id, piece))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _top_up(self, tenant_id: int, piece: _Slice) -> None:
        try:
            async with self._top_ups, piece.lock:
                before = piece.cost
                try:
                    await self._acquire(tenant_id, piece, 0.0)
                except Exception as exc:  # the next reservation that needs the database will say so
                    log.debug("quota top-up failed: %s", exc)
                if piece.cost <= before + _EPSILON:
                    piece.dry_until = time.monotonic() + self.sync_interval_s
        finally:
            piece.topping_up = False

    async def _acquire(self, tenant_id: int, piece: _Slice, cost: float) -> Refusal | None:
        """One round trip: take what ``cost`` still needs (all or nothing) plus what the slice should hold."""
        need_cost = max(0.0, cost - piece.cost)
        need_slots = 0 if piece.slots >= 1 or cost == 0 else 1
        keep_cost, keep_slots = piece.keep(self._horizon)
        consumed, piece.consumed = piece.consumed, 0.0
        params = {
            "tenant": tenant_id,
            "holder": self.holder,
            "cost": cost,
            "need_cost": need_cost,
            "need_slots": need_slots,
            "extra_cost": max(4 * cost, keep_cost - max(0.0, piece.cost - cost)),
            "extra_slots": max(4 if cost else 0, keep_slots - piece.slots),
            "consumed": consumed,
            "lease_s": self.lease_s,
        }
        self.round_trips += 1
        try:
            async with self._engine.connect() as conn:
                row = (await conn.execute(ACQUIRE_SQL, params)).one()
        except DBAPIError as exc:
            piece.consumed += consumed
            if "unknown tenant" in str(exc.orig):
                self._slices.pop(tenant_id, None)
                raise NotFound(f"no tenant with id {tenant_id}") from None
            raise
        except BaseException:
            piece.consumed += consumed
            raise
        if row.reason is not None:
            return Refusal(row.reason, row.limit_value, row.remaining, row.retry_after_s, row.reset_s)
        piece.cost += row.got_cost
        piece.slots += row.got_slots
        return None

    def settle(self, reservation: Reservation, actual_cost: float) -> bool:
        """Charge ``actual_cost`` and give back the rest of the reservation and its slot (no I/O).

        Returns ``False`` if the reservation was already settled or released (nothing happens twice).
        """
        _check_cost("actual cost", actual_cost)
        if reservation.settled:
            return False
        reservation.settled = True
        piece = self._slices.get(reservation.tenant_id)
        if piece is None:
            piece = self._slices[reservation.tenant_id] = _Slice()
        piece.cost += reservation.cost - actual_cost
        piece.consumed += actual_cost
        piece.slots += 1
        piece.in_flight -= 1
        return True

    def release(self, reservation: Reservation) -> bool:
        """Give back a reservation whose request produced nothing billable (same as settling at 0)."""
        return self.settle(reservation, 0.0)

    def _ensure_sync_task(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            loop = asyncio.get_running_loop()
            self._sync_task = loop.create_task(self._sync_loop(), name="weir-quota-sync")

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync()
            except Exception as exc:  # the database may be away; the next round retries
                log.warning("quota sync failed: %s", exc)

    async def sync(self, *, close: bool = False) -> None:
        """Give back unused slices, report settled cost and renew the leases now (one round trip).

        Keeps as much as was reserved since the last sync (the recent demand); with ``close``, keeps nothing.
        """
        async with self._sync_lock:
            now = time.monotonic()
            renew = close or now - self._last_renewal >= self.lease_s / 4
            batch: list[tuple[int, float, int, float]] = []
            for tenant_id in sorted(self._slices):
                piece = self._slices[tenant_id]
                keep_cost, keep_slots = (0.0, 0) if close else piece.keep(self._horizon)
                give_cost = max(0.0, piece.cost - keep_cost) if not piece.lock.locked() else 0.0
                give_slots = max(0, piece.slots - keep_slots) if not piece.lock.locked() else 0
                piece.end_interval()
                if give_cost > _EPSILON or give_slots or piece.consumed or renew:
                    batch.append((tenant_id, give_cost, give_slots, piece.consumed))
                    piece.cost -= give_cost
                    piece.slots -= give_slots
                    piece.consumed = 0.0
            if not batch:
                return
            params = {
                "holder": self.holder,
                "tenants": [b[0] for b in batch],
                "cost": [b[1] for b in batch],
                "slots": [b[2] for b in batch],
                "consumed": [b[3] for b in batch],
                "lease_s": self.lease_s,
                "close": close,
            }
            self.round_trips += 1
            try:
                async with self._engine.connect() as conn:
                    await conn.execute(RETURN_SQL, params)
            except BaseException:
                for tenant_id, give_cost, give_slots, consumed in batch:
                    piece = self._slices[tenant_id]
                    piece.cost += give_cost
                    piece.slots += give_slots
                    piece.consumed += consumed
                raise
            if renew:
                self._last_renewal = now

    async def close(self) -> None:
        """Stop syncing and give back every free slice; leases with reservations still out stay until
        settled by nobody, then expire and are reclaimed."""
        self._closed = True
        for task in [self._sync_task, *self._background]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        try:
            await self.sync(close=True)
        finally:
            await self._engine.dispose()
