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

A reservation can grow while its request runs (``extend``: more cost, no new slot), carved from the
slice like a reservation and refused by the same limits; ``settle`` then charges the actual cost against
the whole grown reservation, once.

``allowance`` says what the tenant has left: its row as last read (each sync that touched the tenant reads
it again, in a second statement) refilled by the clock since, adjusted for this process's own grants and
give-backs, plus this process's free slice. With one process that is exact; with several, another
process's reservations show up at this process's next sync that touches the tenant, and slices other
processes hold free count as spent.

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

from tenants.background import detached
from tenants.records import NotFound

log = logging.getLogger(__name__)

RefusalReason = Literal["rate", "concurrency", "budget"]

ACQUIRE_SQL = sa.text(
    "SELECT * FROM weir_quota_acquire(:tenant, :holder, :cost, :need_cost, :need_slots, :extra_cost, "
    ":extra_slots, :consumed, :lease_s)"
)
STATE_SQL = sa.text(
    "SELECT s.tenant_id, q.cost_per_minute, q.max_concurrency, "
    "q.max_concurrency - s.in_flight AS free_slots, "
    "least(q.cost_per_minute, s.bucket_level + q.cost_per_minute / 60.0 "
    "* greatest(0, extract(epoch FROM clock_timestamp() - s.bucket_updated_at))) AS bucket "
    "FROM quota_state AS s LEFT JOIN quotas AS q USING (tenant_id) "
    "WHERE s.tenant_id = ANY(CAST(:tenants AS bigint[]))"
)
RETURN_SQL = sa.text(
    "SELECT weir_quota_return(:holder, CAST(:tenants AS bigint[]), CAST(:cost AS double precision[]), "
    "CAST(:slots AS integer[]), CAST(:consumed AS double precision[]), :lease_s, :close)"
)
_EPSILON = 1e-9
HORIZON_S = 1.0  # seconds of recent demand a slice is sized for
_MAX_TOP_UPS = 4  # background acquires in flight at once
_FIRST_READ_ATTEMPTS = 3  # reads of a tenant's row for its first allowance (each a racing move dropped)
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
class Limit:
    """One limit as it stands: ``reset_s`` is when it is whole again (``None``: not time-based)."""

    limit: float
    remaining: float
    reset_s: float | None


@dataclass(frozen=True)
class Allowance:
    """What a tenant has left of its per-minute cost bucket and of its concurrency slots (``None``: no
    limit)."""

    rate: Limit | None
    concurrency: Limit | None


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
    # The tenant's row as last read, moved since by this process's own grants and give-backs:
    seen_at: float | None = None  # monotonic time of the reading; None: never read
    rate_limit: float | None = None
    bucket: float = 0.0  # cost in the tenant's bucket, held by no process
    slot_limit: int | None = None
    free_slots: int = 0  # concurrency slots held by no process
    version: int = 0  # bumped by each local move, so that a reading that raced one is dropped

    def take(self, cost: float, slots: int = 1) -> bool:
        if self.cost + _EPSILON < cost or self.slots < slots:
            return False
        self.cost -= cost
        self.slots -= slots
        self.in_flight += slots
        self.reserved_cost += cost
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return True

    def bucket_at(self, now: float) -> float:
        if self.rate_limit is None or self.seen_at is None:
            return 0.0
        refill = self.rate_limit / 60.0 * max(0.0, now - self.seen_at)
        return min(self.rate_limit, self.bucket + refill)

    def read(self, row: sa.Row, now: float) -> None:
        """Take the tenant's row as read from the database."""
        self.rate_limit, self.slot_limit = row.cost_per_minute, row.max_concurrency
        self.bucket = row.bucket or 0.0
        self.free_slots = row.free_slots or 0
        self.seen_at = now

    def moved(self, cost: float, slots: int) -> None:
        """``cost`` and ``slots`` went from the tenant's row to this process (negative: back, where the
        bucket stops at its limit as the database's does)."""
        self.version += 1
        if self.seen_at is None:
            return
        now = time.monotonic()
        if self.rate_limit is not None:
            self.bucket = min(self.rate_limit, self.bucket_at(now) - cost)
        if self.slot_limit is not None:
            self.free_slots -= slots
        self.seen_at = now

    def refused(self, refusal: Refusal) -> None:
        """The refusing limit's remaining part, as the database just said."""
        self.version += 1
        if self.seen_at is None:
            return
        if refusal.reason == "rate":
            self.bucket, self.seen_at = refusal.remaining, time.monotonic()
        elif refusal.reason == "concurrency":
            self.free_slots = int(refusal.remaining)

    def allowance(self, now: float) -> Allowance | None:
        if self.seen_at is None:
            return None
        rate = concurrency = None
        if self.rate_limit is not None:
            remaining = min(self.rate_limit, max(0.0, self.bucket_at(now) + self.cost))
            rate = Limit(self.rate_limit, remaining, (self.rate_limit - remaining) * 60.0 / self.rate_limit)
        if self.slot_limit is not None:
            free = max(0, min(self.slot_limit, self.free_slots + self.slots))
            concurrency = Limit(self.slot_limit, free, None)
        return Allowance(rate, concurrency)

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
        _check_cost("worst-case cost", worst_case_cost)
        refusal = await self._take(tenant_id, worst_case_cost, 1)
        return refusal or Reservation(tenant_id, float(worst_case_cost), next(self._ids))

    async def extend(self, reservation: Reservation, extra_cost: float) -> Refusal | None:
        """Grow an unsettled reservation by ``extra_cost`` (its slot stays the one), or say which limit
        refuses; a refused extension leaves the reservation as it was. Raises like :meth:`reserve`."""
        _check_cost("extra cost", extra_cost)
        if reservation.settled:
            raise ValueError("a settled reservation cannot grow")
        refusal = await self._take(reservation.tenant_id, extra_cost, 0)
        if refusal is None:
            reservation.cost += extra_cost
        return refusal

    async def _take(self, tenant_id: int, cost: float, slots: int) -> Refusal | None:
        """Carve ``cost`` and ``slots`` from the tenant's slice, acquiring more when it falls short."""
        if self._closed:
            raise RuntimeError("the quota manager is closed")
        self._ensure_sync_task()
        piece = self._slice(tenant_id)
        if piece.take(cost, slots):
            self._maybe_top_up(tenant_id, piece)
            return None
        self.waits += 1
        async with piece.lock:
            while not piece.take(cost, slots):
                refusal = await self._acquire(tenant_id, piece, cost, slots)
                if refusal is not None:
                    return refusal
        return None

    def _slice(self, tenant_id: int) -> _Slice:
        piece = self._slices.get(tenant_id)
        if piece is None:
            piece = self._slices[tenant_id] = _Slice()
        return piece

    async def allowance(self, tenant_id: int) -> Allowance | None:
        """What ``tenant_id`` has left now (module docstring); reads its row if this process has not yet
        (again, up to ``_FIRST_READ_ATTEMPTS`` reads, when a grant or give-back raced the read). ``None``
        for an unknown tenant; raises SQLAlchemy's errors when that read fails."""
        piece = self._slice(tenant_id)
        for _ in range(_FIRST_READ_ATTEMPTS):  # a grant or give-back during a read makes it drop that reading
            if piece.seen_at is not None:
                break
            await self._read([tenant_id])
        return piece.allowance(time.monotonic())

    async def _read(self, tenant_ids: list[int]) -> None:
        """Read the tenants' rows into their slices' views (one round trip)."""
        versions = {t: self._slice(t).version for t in tenant_ids}
        self.round_trips += 1
        async with self._engine.connect() as conn:
            rows = (await conn.execute(STATE_SQL, {"tenants": tenant_ids})).all()
        now = time.monotonic()
        for row in rows:
            piece = self._slices.get(row.tenant_id)
            if piece is not None and piece.version == versions[row.tenant_id]:
                piece.read(row, now)

    def _maybe_top_up(self, tenant_id: int, piece: _Slice) -> None:
        """Refill a slice in the background before it runs dry: reservations rarely wait on the database."""
        keep_cost, _ = piece.keep(self._horizon)
        if piece.topping_up or piece.lock.locked() or piece.cost >= _TOP_UP_AT * keep_cost:
            return
        if time.monotonic() < piece.dry_until:
            return
        piece.topping_up = True
        task = detached(self._top_up(tenant_id, piece))  # for the tenant's later requests, not this one
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _top_up(self, tenant_id: int, piece: _Slice) -> None:
        try:
            async with self._top_ups, piece.lock:
                before = piece.cost
                try:
                    await self._acquire(tenant_id, piece, 0.0, 0)
                except Exception as exc:  # the next reservation that needs the database will say so
                    log.debug("quota top-up failed: %s", exc)
                if piece.cost <= before + _EPSILON:
                    piece.dry_until = time.monotonic() + self.sync_interval_s
        finally:
            piece.topping_up = False

    async def _acquire(self, tenant_id: int, piece: _Slice, cost: float, slots: int) -> Refusal | None:
        """One round trip: take what ``cost`` and ``slots`` still need (all or nothing) plus what the slice
        should hold."""
        need_cost = max(0.0, cost - piece.cost)
        need_slots = max(0, slots - piece.slots)
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
            refusal = Refusal(row.reason, row.limit_value, row.remaining, row.retry_after_s, row.reset_s)
            piece.refused(refusal)
            return refusal
        piece.cost += row.got_cost
        piece.slots += row.got_slots
        piece.moved(row.got_cost, row.got_slots)
        return None

    def settle(self, reservation: Reservation, actual_cost: float) -> bool:
        """Charge ``actual_cost`` and give back the rest of the reservation and its slot (no I/O).

        Returns ``False`` if the reservation was already settled or released (nothing happens twice).
        """
        _check_cost("actual cost", actual_cost)
        if reservation.settled:
            return False
        reservation.settled = True
        piece = self._slice(reservation.tenant_id)
        piece.cost += reservation.cost - actual_cost
        piece.consumed += actual_cost
        piece.slots += 1
        piece.in_flight -= 1
        return True

    def release(self, reservation: Reservation) -> bool:
        """Give back a reservation whose request produced nothing billable (same as settling at 0)."""
        return self.settle(reservation, 0.0)

    @property
    def engine(self) -> AsyncEngine:
        """The quota statements' own engine (``quota_engine``)."""
        return self._engine

    def _ensure_sync_task(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = detached(self._sync_loop(), name="weir-quota-sync")

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sync_interval_s)
            try:
                await self.sync()
            except Exception as exc:  # the database may be away; the next round retries
                log.warning("quota sync failed: %s", exc)

    async def sync(self, *, close: bool = False) -> None:
        """Give back unused slices, report settled cost and renew the leases now (one round trip), then
        read the rows of the tenants concerned (another).

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
            for tenant_id, give_cost, give_slots, _ in batch:
                self._slices[tenant_id].moved(-give_cost, -give_slots)
            if not close:
                await self._read([b[0] for b in batch])

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
