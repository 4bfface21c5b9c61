"""What the dashboard shows: usage, latency against targets and refusals per window, tenant and interval,
the ledger page by page, and each tenant's quota use.

Windows are half-open UTC intervals ``[since, until)``; a request belongs to the moment it finished, a
refusal to the moment it was refused. Costs are exact (``Decimal`` cost units).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tenants.models import SHED_REASONS, api_keys, quota_state, quotas, shed_events, tenants, usage_events
from tenants.records import InvalidValue

Step = Literal["hour", "day"]
MAX_PAGE = 500


@dataclass(frozen=True)
class Window:
    """``[since, until)`` in UTC; both must be timezone-aware and ``since < until``."""

    since: datetime
    until: datetime

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            value = getattr(self, name)
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise InvalidValue(f"window {name} must be a timezone-aware datetime, got {value!r}")
            object.__setattr__(self, name, value.astimezone(UTC))
        if self.since >= self.until:
            raise InvalidValue(f"window must end after it starts ({self.since} >= {self.until})")

    @classmethod
    def last(cls, span: timedelta, now: datetime | None = None) -> Window:
        """The ``span`` up to ``now`` (default: the current time)."""
        end = now or datetime.now(UTC)
        return cls(end - span, end)


def _no_refusals() -> dict[str, int]:
    return dict.fromkeys(SHED_REASONS, 0)


@dataclass(frozen=True)
class UsageFigures:
    """Totals over a window. ``slo_met`` counts requests within both of their tenant's targets (TTFT, and
    TPOT when the request has one); percentiles are seconds, ``None`` without a measurement."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    cost_units: Decimal = Decimal(0)
    slo_met: int = 0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    refusals: dict[str, int] = field(default_factory=_no_refusals)

    @property
    def slo_attainment(self) -> float | None:
        """Share of requests that met their targets; ``None`` without requests."""
        return self.slo_met / self.requests if self.requests else None

    @property
    def refused(self) -> int:
        return sum(self.refusals.values())


@dataclass(frozen=True)
class TenantFigures:
    """One tenant's settings, usage over the window and quota use now (``None`` limits: unlimited).

    ``cost_last_minute`` is the cost settled in the last 60 s, ``slots_held`` the concurrency slots API
    processes hold for it (its requests in flight plus idle slots leased to processes), and
    ``spent_this_month`` the cost settled since the start of the UTC month."""

    tenant_id: int
    name: str
    status: str
    weight: float
    ttft_target_s: float
    tpot_target_s: float
    figures: UsageFigures
    cost_per_minute: float | None
    cost_last_minute: Decimal
    max_concurrency: int | None
    slots_held: int
    monthly_budget: float | None
    spent_this_month: Decimal


@dataclass(frozen=True)
class SeriesPoint:
    period_start: datetime
    cost_units: Decimal
    requests: int
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    refusals: dict[str, int]


@dataclass(frozen=True)
class LedgerFilter:
    """Which ledger rows to list; ``None`` matches all."""

    tenant_id: int | None = None
    key_id: int | None = None
    status: str | None = None
    finish_reason: str | None = None


@dataclass(frozen=True)
class LedgerRow:
    """One request as billed; ``key_prefix`` is ``None`` for a request without a key (or a deleted key)."""

    request_id: str
    tenant_id: int
    tenant_name: str
    key_id: int | None
    key_prefix: str | None
    model: str
    started_at: datetime
    finished_at: datetime
    status: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_units: Decimal
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None


def _slo_met(ttft: sa.ColumnElement, tpot: sa.ColumnElement) -> sa.ColumnElement[bool]:
    """Whether a request met its tenant's targets (the tenants table joined as ``tenants``)."""
    return sa.and_(
        ttft <= tenants.c.ttft_target_s,
        sa.or_(tpot.is_(None), tpot <= tenants.c.tpot_target_s),
    )


def _in(column: sa.ColumnElement, window: Window) -> sa.ColumnElement[bool]:
    return sa.and_(column >= window.since, column < window.until)


def _usage_query(window: Window, tenant_id: int | None) -> sa.Select:
    u = usage_events.c
    pct = [
        sa.func.percentile_cont(q).within_group(u[f"{metric}_s"]).label(f"{metric}_p{int(q * 100)}")
        for metric in ("ttft", "tpot")
        for q in (0.5, 0.99)
    ]
    query = (
        sa.select(
            sa.func.count().label("requests"),
            sa.func.coalesce(sa.func.sum(u.prompt_tokens), 0).label("prompt_tokens"),
            sa.func.coalesce(sa.func.sum(u.cached_tokens), 0).label("cached_tokens"),
            sa.func.coalesce(sa.func.sum(u.output_tokens), 0).label("output_tokens"),
            sa.func.coalesce(sa.func.sum(u.cost), 0).label("cost_units"),
            sa.func.count().filter(_slo_met(u.ttft_s, u.tpot_s)).label("slo_met"),
            *pct,
        )
        .select_from(usage_events.outerjoin(tenants, tenants.c.id == u.tenant_id))
        .where(_in(u.finished_at, window))
    )
    return query if tenant_id is None else query.where(u.tenant_id == tenant_id)


async def _refusals(conn: AsyncConnection, window: Window, tenant_id: int | None) -> dict[str, int]:
    query = (
        sa.select(shed_events.c.reason, sa.func.count())
        .where(_in(shed_events.c.at, window))
        .group_by(shed_events.c.reason)
    )
    if tenant_id is not None:
        query = query.where(shed_events.c.tenant_id == tenant_id)
    counts = _no_refusals()
    for reason, count in (await conn.execute(query)).all():
        counts[reason] = counts.get(reason, 0) + count
    return counts


async def _figures(conn: AsyncConnection, window: Window, tenant_id: int | None) -> UsageFigures:
    row = (await conn.execute(_usage_query(window, tenant_id))).one()
    values = dict(row._mapping)
    values["cost_units"] = Decimal(values["cost_units"])
    return UsageFigures(**values, refusals=await _refusals(conn, window, tenant_id))


async def overview(db: AsyncEngine, window: Window, tenant_id: int | None = None) -> UsageFigures:
    """Usage, latency and refusals over ``window``, of one tenant or all."""
    async with db.connect() as conn:
        return await _figures(conn, window, tenant_id)


def _month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


async def _settled_cost(conn: AsyncConnection, window: Window) -> dict[int, Decimal]:
    u = usage_events.c
    query = (
        sa.select(u.tenant_id, sa.func.sum(u.cost)).where(_in(u.finished_at, window)).group_by(u.tenant_id)
    )
    return {tenant: Decimal(cost) for tenant, cost in (await conn.execute(query)).all()}


async def tenant_table(db: AsyncEngine, window: Window) -> list[TenantFigures]:
    """Every tenant (by name) with its figures over ``window`` and its quota use now."""
    now = datetime.now(UTC)
    query = (
        sa.select(tenants, quotas, quota_state.c.in_flight)
        .select_from(tenants.outerjoin(quotas).outerjoin(quota_state))
        .order_by(tenants.c.name)
    )
    async with db.connect() as conn:
        rows = (await conn.execute(query)).all()
        last_minute = await _settled_cost(conn, Window(now - timedelta(minutes=1), now))
        month = await _settled_cost(conn, Window(_month_start(now), now))
        table = []
        for row in rows:
            table.append(
                TenantFigures(
                    tenant_id=row.id,
                    name=row.name,
                    status=row.status,
                    weight=row.weight,
                    ttft_target_s=row.ttft_target_s,
                    tpot_target_s=row.tpot_target_s,
                    figures=await _figures(conn, window, row.id),
                    cost_per_minute=row.cost_per_minute,
                    cost_last_minute=last_minute.get(row.id, Decimal(0)),
                    max_concurrency=row.max_concurrency,
                    slots_held=row.in_flight or 0,
                    monthly_budget=row.monthly_budget,
                    spent_this_month=month.get(row.id, Decimal(0)),
                )
            )
    return table


def _steps(window: Window, step: Step) -> list[Window]:
    """The window cut at whole hours or UTC days (the first and last pieces may be partial)."""
    size = timedelta(hours=1) if step == "hour" else timedelta(days=1)
    start = window.since.replace(minute=0, second=0, microsecond=0)
    if step == "day":
        start = start.replace(hour=0)
    pieces = []
    while start < window.until:
        pieces.append(Window(max(start, window.since), min(start + size, window.until)))
        start += size
    return pieces


async def tenant_series(db: AsyncEngine, tenant_id: int, window: Window, step: Step) -> list[SeriesPoint]:
    """One point per hour or UTC day of ``window`` (every interval, empty ones too)."""
    if step not in ("hour", "day"):
        raise InvalidValue(f"step must be 'hour' or 'day', got {step!r}")
    points = []
    async with db.connect() as conn:
        for piece in _steps(window, step):
            f = await _figures(conn, piece, tenant_id)
            points.append(
                SeriesPoint(
                    piece.since,
                    f.cost_units,
                    f.requests,
                    f.ttft_p50,
                    f.ttft_p99,
                    f.tpot_p50,
                    f.tpot_p99,
                    f.refusals,
                )
            )
    return points


def _ledger_query() -> sa.Select:
    u = usage_events.c
    return sa.select(
        u.request_id,
        u.tenant_id,
        sa.func.coalesce(tenants.c.name, sa.cast(u.tenant_id, sa.Text)).label("tenant_name"),
        u.key_id,
        api_keys.c.prefix.label("key_prefix"),
        u.model,
        u.started_at,
        u.finished_at,
        u.status,
        u.finish_reason,
        u.prompt_tokens,
        u.cached_tokens,
        u.output_tokens,
        u.cost.label("cost_units"),
        u.queue_s,
        u.ttft_s,
        u.tpot_s,
        u.e2e_s,
    ).select_from(
        usage_events.outerjoin(tenants, tenants.c.id == u.tenant_id).outerjoin(
            api_keys, api_keys.c.id == u.key_id
        )
    )


def _ledger_row(row: sa.Row) -> LedgerRow:
    values = dict(row._mapping)
    values["cost_units"] = Decimal(values["cost_units"])
    return LedgerRow(**values)


def _encode_cursor(row: LedgerRow) -> str:
    raw = f"{row.finished_at.isoformat()}|{row.request_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        moment, request_id = raw.split("|", 1)
        finished = datetime.fromisoformat(moment)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidValue(f"not a ledger page cursor: {cursor!r}") from None
    if finished.tzinfo is None:
        raise InvalidValue(f"not a ledger page cursor: {cursor!r}")
    return finished, request_id


async def ledger_page(
    db: AsyncEngine, filters: LedgerFilter, before: str | None = None, limit: int = 50
) -> tuple[list[LedgerRow], str | None]:
    """Ledger rows newest first (by finishing time, then request id), ``limit`` of them after the cursor
    ``before`` (``None``: from the newest); returns the rows and the cursor of the next page (``None``: no
    more)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        raise InvalidValue(f"page size must be 1 to {MAX_PAGE}, got {limit!r}")
    u = usage_events.c
    query = _ledger_query().order_by(u.finished_at.desc(), u.request_id.desc()).limit(limit + 1)
    for name in ("tenant_id", "key_id", "status", "finish_reason"):
        value = getattr(filters, name)
        if value is not None:
            query = query.where(u[name] == value)
    if before is not None:
        finished, request_id = _decode_cursor(before)
        query = query.where(sa.tuple_(u.finished_at, u.request_id) < sa.tuple_(finished, request_id))
    async with db.connect() as conn:
        rows = [_ledger_row(row) for row in (await conn.execute(query)).all()]
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, _encode_cursor(rows[-1]) if more else None


async def ledger_entry(db: AsyncEngine, request_id: str) -> LedgerRow | None:
    """One request by id, or ``None``."""
    async with db.connect() as conn:
        row = (await conn.execute(_ledger_query().where(usage_events.c.request_id == request_id))).first()
    return _ledger_row(row) if row is not None else None
