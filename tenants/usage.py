"""The usage ledger: a batched, idempotent writer that never loses a usage event.

``submit`` only appends to an in-memory buffer (bounded: past ``max_buffer`` usage events, a usage event goes
straight to the spill file). A background task writes batches (by size or every ``flush_interval_s``) with
``INSERT ... ON CONFLICT DO NOTHING`` on the event's id, so a replayed event is never counted twice. When
the database cannot be reached, batches are appended (and fsynced) to a spill file under
``<state dir>/spill``; spill files are replayed when the writer starts and when the database returns,
including files left by a writer process that died (a live writer holds a lock on its own file; others
are looked for every ``SPILL_SCAN_S``). A file is deleted only after all its events are written.

Shed events (refusals, which cost a client nothing to cause) have a bound of their own: past ``max_sheds``
of them waiting, a new one is dropped and counted in ``sheds_dropped`` (with a warning at most every
``DROP_WARNING_S``), never spilled on the caller's turn, so that a flood of refusals can neither make each
refusal write and fsync a file on the event loop nor crowd usage events out of the buffer. Usage events
are never dropped: the ledger of what was served stays whole.

What can still be lost: events submitted but neither written nor spilled when the process is killed
(at most ``flush_interval_s`` of them while the database is up, ``retry_interval_s`` while it is away),
and events when the database and the disk fail together (logged). An event the database refuses for its
values (it passed validation, yet PostgreSQL rejects it) is set aside in ``spill/rejected.jsonl.bad`` with
an error in the log, so that it cannot block the ledger.

Spilled events are tenants' usage: the spill directory is kept private (created 0700, an existing one of
this user's set back to 0700; a link or someone else's directory is refused and nothing is spilled there)
and every file in it is created 0600. A spill file is read back as untrusted input: every line must be a
whole record with exactly the event's fields, of the right types and ranges (the checks ``submit`` makes,
including the request id's format); a line that is not (torn, not UTF-8, not JSON, a field missing, extra
or out of range) is set aside, as it was, in ``spill/quarantine.jsonl.bad`` with an error in the log, and
the file's good events are written all the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import math
import os
import re
import stat
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import IO, Any

import asyncpg
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.background import detached
from tenants.db import state_dir
from tenants.models import SHED_REASONS, shed_events, usage_events

log = logging.getLogger(__name__)

_INT32 = 2**31 - 1
SPILL_SCAN_S = 10.0
DROP_WARNING_S = 60.0
REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # the API's are chatcmpl-<hex>, cmpl-<hex>
_EVENT_ID = re.compile(r"[0-9a-f]{32}")
_MAX_TEXT = 256
REJECTED_FILE = "rejected.jsonl.bad"
QUARANTINE_FILE = "quarantine.jsonl.bad"
COST_QUANTUM = Decimal("0.000001")  # the ledger's numeric(24, 6)
MAX_COST = Decimal(10**18) - COST_QUANTUM


def _check_id(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be a non-negative 64-bit int, got {value!r}")


def _check_moment(name: str, value: datetime) -> None:
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise ValueError(f"event {name} must be a timezone-aware datetime, got {value!r}")


def exact_cost(value: Decimal | float | int) -> Decimal:
    """``value`` in cost units as the ledger stores it: a ``Decimal`` rounded (half to even) to
    :data:`COST_QUANTUM`; a float is taken at its shortest decimal form (``0.1 * 3`` -> ``0.3``).
    ``ValueError`` unless it is a finite number from 0 to :data:`MAX_COST`."""
    if isinstance(value, bool) or not isinstance(value, Decimal | float | int):
        raise ValueError(f"usage event cost must be a finite number >= 0, got {value!r}")
    exact = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    if not exact.is_finite() or not 0 <= exact <= MAX_COST:
        raise ValueError(f"usage event cost must be a finite number from 0 to {MAX_COST}, got {value!r}")
    return exact.quantize(COST_QUANTUM, rounding=ROUND_HALF_EVEN)


def _utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class UsageEvent:
    """One finished (or failed, or cancelled) request as billed: costs in cost units, durations in seconds.

    ``request_id`` matches :data:`REQUEST_ID`; ``model``, ``status`` and ``finish_reason`` are at most 256
    characters."""

    request_id: str
    tenant_id: int
    key_id: int | None
    model: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: Decimal  # given as a number, kept rounded to COST_QUANTUM
    status: str  # e.g. "ok", "error", "cancelled"
    finish_reason: str | None  # e.g. "stop", "length", None when it never finished
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    started_at: datetime
    finished_at: datetime

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not REQUEST_ID.fullmatch(self.request_id):
            raise ValueError(
                f"usage event request id must match {REQUEST_ID.pattern}, got {self.request_id!r}"
            )
        _check_id("tenant_id", self.tenant_id)
        if self.key_id is not None:
            _check_id("key_id", self.key_id)
        for name in ("model", "status", "finish_reason"):
            value = getattr(self, name)
            if (value is not None or name != "finish_reason") and (
                not isinstance(value, str) or "\x00" in value or len(value) > _MAX_TEXT
            ):
                raise ValueError(
                    f"usage event {name} must be text without NUL of at most {_MAX_TEXT}, got {value!r}"
                )
        for name in ("prompt_tokens", "cached_tokens", "output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _INT32:
                raise ValueError(f"usage event {name} must be a non-negative int, got {value!r}")
        object.__setattr__(self, "cost", exact_cost(self.cost))
        for name in ("queue_s", "ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float) and math.isfinite(value) and value >= 0
            ):
                raise ValueError(f"usage event {name} must be a finite number >= 0, got {value!r}")
        for name in ("started_at", "finished_at"):
            _check_moment(name, getattr(self, name))


@dataclass(frozen=True)
class ShedEvent:
    """A request refused before it ran; ``reason`` is one of :data:`tenants.models.SHED_REASONS`."""

    tenant_id: int
    reason: str
    at: datetime = field(default_factory=_utc_now)
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __post_init__(self) -> None:
        _check_id("tenant_id", self.tenant_id)
        _check_moment("at", self.at)
        if not isinstance(self.event_id, str) or not _EVENT_ID.fullmatch(self.event_id):
            raise ValueError(f"shed event id must be 32 hex digits, got {self.event_id!r}")
        if self.reason not in SHED_REASONS:
            raise ValueError(f"unknown shed reason {self.reason!r} (one of {', '.join(SHED_REASONS)})")


Event = UsageEvent | ShedEvent
_KINDS: dict[str, type[UsageEvent] | type[ShedEvent]] = {"usage": UsageEvent, "shed": ShedEvent}
_DATETIME_FIELDS = ("started_at", "finished_at", "at")


def _to_line(event: Event) -> str:
    record: dict[str, Any] = asdict(event)
    for name in _DATETIME_FIELDS:
        if name in record:
            record[name] = record[name].isoformat()
    if isinstance(event, UsageEvent):
        record["cost"] = str(event.cost)  # exact; read back by _from_line
    record["kind"] = "usage" if isinstance(event, UsageEvent) else "shed"
    return json.dumps(record, separators=(",", ":")) + "\n"


def _from_line(line: bytes) -> Event:
    """The event a spill file's line holds, checked as ``submit`` checks events; ``ValueError`` (or
    ``TypeError``) for anything else."""
    record = json.loads(line.decode("utf-8"))
    kind = record.pop("kind", None) if isinstance(record, dict) else None
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ValueError("not a usage or shed event record")
    cls = _KINDS[kind]
    names = {f.name for f in fields(cls)}
    if set(record) != names:
        raise ValueError(f"fields missing or unexpected: {', '.join(sorted(set(record) ^ names))}")
    for name in _DATETIME_FIELDS:
        if name in record:
            if not isinstance(record[name], str):
                raise ValueError(f"{name} must be an ISO 8601 time, got {record[name]!r}")
            record[name] = datetime.fromisoformat(record[name])
    if isinstance(record.get("cost"), str):  # older files hold a JSON number
        try:
            record["cost"] = Decimal(record["cost"])
        except ArithmeticError:
            raise ValueError(f"cost must be a number, got {record['cost']!r}") from None
    return cls(**record)


async def write_events(engine: AsyncEngine, events: list[Event]) -> None:
    """Insert events idempotently (an id already present is skipped), in one transaction."""
    usage = [asdict(e) for e in events if isinstance(e, UsageEvent)]
    shed = [asdict(e) for e in events if isinstance(e, ShedEvent)]
    async with engine.begin() as conn:
        if usage:
            await conn.execute(insert(usage_events).on_conflict_do_nothing(), usage)
        if shed:
            await conn.execute(insert(shed_events).on_conflict_do_nothing(), shed)


class UsageWriter:
    """``submit(event)`` (never blocks, never raises for an outage), ``record_shed``, ``flush``, ``close``."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        spill_dir: Path | None = None,
        batch_size: int = 500,
        flush_interval_s: float = 0.2,
        retry_interval_s: float = 1.0,
        max_buffer: int = 20_000,
        max_sheds: int = 10_000,
    ) -> None:
        self._engine = engine
        self.spill_dir = Path(spill_dir) if spill_dir is not None else state_dir() / "spill"
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.max_buffer = max_buffer
        self.max_sheds = max_sheds
        self.sheds_dropped = 0  # shed events refused past max_sheds waiting
        self._sheds = 0  # shed events in the buffer
        self._next_drop_warning = 0.0
        self._buffer: deque[Event] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._spill: IO[str] | None = None
        self._spill_seq = 0
        self._db_down = False
        self._closed = False
        self._token = uuid.uuid4().hex

    @property
    def pending(self) -> int:
        """Events accepted but not yet in the database or a spill file."""
        return len(self._buffer)

    @property
    def database_reachable(self) -> bool:
        return not self._db_down

    def start(self) -> None:
        """Start the background writer (replaying leftover spill files first); ``submit`` starts it too."""
        if self._task is None or self._task.done():
            self._task = detached(self._run(), name="weir-usage-writer")

    def submit(self, event: Event) -> None:
        """Queue an event for the ledger. Never blocks; never raises because the database is away."""
        if not isinstance(event, UsageEvent | ShedEvent):
            raise TypeError(f"not a usage or shed event: {event!r}")
        shed = isinstance(event, ShedEvent)
        if shed and not self._closed and self._sheds >= self.max_sheds:
            self._drop_shed()
            return
        usage_full = not shed and len(self._buffer) - self._sheds >= self.max_buffer
        if (self._closed or usage_full) and self._spill_events([event]):
            return
        if shed:
            self._sheds += 1
        self._buffer.append(event)
        self._idle.clear()
        if len(self._buffer) >= self.batch_size:
            self._wake.set()
        if not self._closed:
            self.start()

    def record_shed(self, tenant_id: int, reason: str) -> None:
        """Record a refused request (reason: rate, concurrency, budget, queue, slo, kv, deadline)."""
        self.submit(ShedEvent(tenant_id=tenant_id, reason=reason))

    def _drop_shed(self) -> None:
        """Count a shed event dropped; warn at most once every ``DROP_WARNING_S``."""
        self.sheds_dropped += 1
        now = time.monotonic()
        if now >= self._next_drop_warning:
            self._next_drop_warning = now + DROP_WARNING_S
            log.warning(
                "%d refusals waiting for the ledger: later ones are not recorded (%d dropped so far)",
                self._sheds,
                self.sheds_dropped,
            )

    async def flush(self) -> None:
        """Wait until every event submitted so far is in the database or in a spill file."""
        if not self._buffer:
            return
        self.start()
        self._wake.set()
        await self._idle.wait()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Flush (for at most ``timeout_s``), stop the background task and close the spill file; events
        still queued then go to the spill file."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), timeout_s)
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._buffer:
            self._spill_events(self._take(len(self._buffer)))
        self._close_spill()

    async def replay_spill(self) -> int:
        """Write every spill file that no live writer holds (including this writer's own) into the
        database and delete it. Returns the number of events replayed; raises if the database is away."""
        self._close_spill()
        replayed = 0
        if not self.spill_dir.is_dir():
            return 0
        try:
            _private_dir(self.spill_dir)
        except OSError as exc:
            log.error("usage spill files not replayed: %s", exc)
            return 0
        for path in sorted(self.spill_dir.glob("*.jsonl")):
            try:
                handle = _open_spill_file(path)
            except FileNotFoundError:
                continue  # replayed meanwhile by another writer
            except OSError as exc:
                log.error("usage spill file %s not replayed: %s", path, exc)
                continue
            with handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer is still appending to it
                events, bad = self._read_events(handle, path)
                for start in range(0, len(events), self.batch_size):
                    await self._write(events[start : start + self.batch_size])
                if not bad or self._set_aside(QUARANTINE_FILE, b"".join(bad)):  # else kept for the next try
                    path.unlink(missing_ok=True)
                replayed += len(events)
        return replayed

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_scan = 0.0
        while True:
            try:
                if not self._db_down and loop.time() >= next_scan:
                    # leftovers of writers that died, found at start and then every SPILL_SCAN_S
                    next_scan = loop.time() + SPILL_SCAN_S
                    if self._spill_files_exist():
                        await self._try_replay()
                await self._round()
            except Exception:  # keep the writer alive whatever happens; the events stay queued
                log.exception("usage writer round failed")
                await asyncio.sleep(self.retry_interval_s)

    async def _round(self) -> None:
        """Wait for a batch (or the flush interval), then write it, or spill it while the database is away."""
        if not self._buffer:
            self._idle.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                self._wake.wait(), self.retry_interval_s if self._db_down else self.flush_interval_s
            )
        self._wake.clear()
        if self._db_down:
            self._spill_or_keep(self._take(len(self._buffer)))
            await self._try_replay()
            return
        while self._buffer:
            batch = self._take(self.batch_size)
            try:
                await self._write(batch)
            except asyncio.CancelledError:  # closing while the database hangs: keep the batch on disk
                self._spill_events(batch)  # (it may be written as well: replay skips what is there)
                raise
            except Exception as exc:
                log.warning("usage ledger unreachable, spilling %d events: %s", len(batch), exc)
                self._db_down = True
                self._spill_or_keep(batch + self._take(len(self._buffer)))
                return

    async def _write(self, events: list[Event]) -> None:
        """Write a batch; if the database rejects a value, write the rest and set the bad events aside in
        ``rejected.jsonl.bad`` (kept for inspection, never replayed) so they cannot block the ledger."""
        try:
            await write_events(self._engine, events)
            return
        except Exception as exc:
            if not _rejects_values(exc):
                raise  # an outage (or a missing schema): the caller spills the batch
        for event in events:
            try:
                await write_events(self._engine, [event])
            except Exception as exc:
                if not _rejects_values(exc):
                    raise
                log.error("usage event %s rejected by the database: %s", event, exc)
                self._set_aside(REJECTED_FILE, _to_line(event).encode())

    def _take(self, count: int) -> list[Event]:
        events = [self._buffer.popleft() for _ in range(min(count, len(self._buffer)))]
        self._sheds -= _count_sheds(events)
        return events

    async def _try_replay(self) -> None:
        try:
            count = await self.replay_spill()
        except Exception as exc:
            self._db_down = True
            log.debug("spill replay failed: %s", exc)
            return
        if count:
            log.info("replayed %d spilled usage events", count)
        self._db_down = False

    def _spill_files_exist(self) -> bool:
        return self.spill_dir.is_dir() and any(self.spill_dir.glob("*.jsonl"))

    def _spill_events(self, events: list[Event]) -> bool:
        """Append events to this writer's spill file and fsync it; ``False`` if the disk failed too."""
        if not events:
            return True
        try:
            if self._spill is None:
                _private_dir(self.spill_dir)
                self._spill_seq += 1
                path = self.spill_dir / f"usage-{self._token}-{self._spill_seq}.jsonl"
                # held open (and locked) while this writer lives
                self._spill = open(_open_private(path, os.O_EXCL), "a")  # noqa: SIM115
                fcntl.flock(self._spill, fcntl.LOCK_EX)
            self._spill.write("".join(_to_line(e) for e in events))
            self._spill.flush()
            os.fsync(self._spill.fileno())
        except OSError as exc:
            log.error("cannot spill %d usage events to %s: %s", len(events), self.spill_dir, exc)
            self._close_spill()  # a torn line stays the last line of its file, where replay skips it
            return False
        return True

    def _spill_or_keep(self, events: list[Event]) -> None:
        """Spill events; if even the disk fails, keep them in memory for the next round."""
        if not self._spill_events(events):
            self._buffer.extendleft(reversed(events))
            self._sheds += _count_sheds(events)

    def _close_spill(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None

    def _read_events(self, handle: IO[bytes], path: Path) -> tuple[list[Event], list[bytes]]:
        """The events of a spill file, and the lines that are not events (each ending in a newline)."""
        events: list[Event] = []
        bad: list[bytes] = []
        for number, line in enumerate(handle, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("a torn last line")
                events.append(_from_line(line))
            except (ValueError, TypeError, RecursionError) as exc:  # whatever the line holds
                log.error("%s:%d: spilled record set aside in %s: %s", path, number, QUARANTINE_FILE, exc)
                bad.append(line if line.endswith(b"\n") else line + b"\n")
        return events, bad

    def _set_aside(self, name: str, lines: bytes) -> bool:
        """Append lines to a file of records kept for inspection and never replayed; ``False`` if the
        disk failed (logged)."""
        try:
            _private_dir(self.spill_dir)
            fd = _open_private(self.spill_dir / name, 0)
            try:
                os.write(fd, lines)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("could not set aside %r in %s: %s", lines[:1000], self.spill_dir / name, exc)
            return False
        return True


def _count_sheds(events: list[Event]) -> int:
    return sum(isinstance(event, ShedEvent) for event in events)


def _private_dir(path: Path) -> None:
    """Make ``path`` (and its parents) if missing and leave it a directory of this user's with mode 0700;
    ``PermissionError`` for a link or someone else's directory."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise PermissionError(f"{path} belongs to another user")
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # an older Weir made it 0755
    finally:
        os.close(fd)


def _open_spill_file(path: Path) -> IO[bytes]:
    """A spill file opened to read (and lock); a link or anything but a regular file is refused."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return open(fd, "rb")


def _open_private(path: Path, flags: int) -> int:
    """Open ``path`` to append (created 0600; never through a link); an existing file is set to 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _rejects_values(exc: BaseException) -> bool:
    """Whether the database refused the values themselves (SQLSTATE class 22 or an argument it cannot
    encode), as opposed to being unreachable."""
    for _ in range(4):  # SQLAlchemy's error -> the adapter's error -> asyncpg's
        if isinstance(exc, asyncpg.exceptions.DataError | sa_exc.DataError):
            return True
        cause = getattr(exc, "orig", None) or exc.__cause__
        if cause is None:
            return False
        exc = cause
    return False
