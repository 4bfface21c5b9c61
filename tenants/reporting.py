"""What the dashboard shows: usage, latency against targets and refusals per window, tenant and interval,
the ledger page by page, and each tenant's quota use.

Windows are half-open UTC intervals ``[since, until)``; a request belongs to the moment it finished, a
refusal to the moment it was refused. Costs are exact (``Decimal`` cost units). The figures refresh
the rollups first, then read whole days and hours from them and only the partial hours at a window's
ends from the raw ledger (docs/architecture.md, "Money, rollups and the figures the dashboard shows").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.models import (
    SHED_REASONS,
    api_keys,
    latency_rollups,
    quota_state,
    quotas,
    shed_events,
    shed_rollups,
    tenants,
    usage_events,
    usage_rollups,
)
from tenants.records import InvalidValue
from tenants.rollups import (
    DAY,
    HOUR,
    LATENCY_BUCKETS,
    SLO_MET_SQL,
    ceil_to,
    floor_to,
    percentile,
    refresh_rollups,
)

Step = Literal["hour", "day"]
MAX_PAGE = 500
MAX_SERIES_POINTS = 500  # the most intervals one series holds (a chart is 484 pixels wide)


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


@dataclass(frozen=True)
class _Plan:
    """Where a window's figures come from: raw rows for the parts not covering a whole hour, hourly
    rollups for whole hours outside whole days, daily rollups for whole days (when allowed)."""

    raw: list[Window]
    hours: list[Window]
    days: list[Window]

    @classmethod
    def of(cls, window: Window, use_days: bool = True) -> _Plan:
        h1, h2 = ceil_to(window.since, HOUR), floor_to(window.until, HOUR)
        if h1 >= h2:
            return cls([window], [], [])
        raw = _nonempty((window.since, h1), (h2, window.until))
        d1, d2 = ceil_to(h1, DAY), floor_to(h2, DAY)
        if not use_days or d1 >= d2:
            return cls(raw, [Window(h1, h2)], [])
        return cls(raw, _nonempty((h1, d1), (d2, h2)), [Window(d1, d2)])


def _nonempty(*spans: tuple[datetime, datetime]) -> list[Window]:
    return [Window(since, until) for since, until in spans if since < until]


def _within(column: sa.ColumnElement, windows: list[Window]) -> sa.ColumnElement[bool]:
    return sa.or_(*(sa.and_(column >= w.since, column < w.until) for w in windows))


# How figures are grouped: one total, per tenant, or per hour or day.
Group = Literal["all", "tenant", "hour", "day"]


def _group_key(group: Group, tenant: sa.ColumnElement, moment: sa.ColumnElement) -> list[sa.ColumnElement]:
    """The grouping column(s) of a source: none for one total, else the tenant or the period's start."""
    if group == "all":
        return []
    if group == "tenant":
        return [tenant]
    return [sa.func.date_trunc(group, moment, "UTC")]


@dataclass(frozen=True)
class _Source:
    """One table read for a figure: its aggregate columns, the tenant and time columns that filter and
    group it, a fixed condition, and plain columns to select and group by (``group_also``) or only to
    select (``constants``)."""

    table: sa.FromClause
    columns: tuple[sa.ColumnElement, ...]
    tenant: sa.ColumnElement
    moment: sa.ColumnElement
    condition: tuple[sa.ColumnElement[bool], ...] = ()
    group_also: tuple[sa.ColumnElement, ...] = ()
    constants: tuple[sa.ColumnElement, ...] = ()  # selected before group_also, not grouped

    def select(self, windows: list[Window], group: Group, tenant_id: int | None) -> sa.Select:
        key = _group_key(group, self.tenant, self.moment)
        keyed = [column.label("k") for column in key] or [sa.literal_column("0").label("k")]
        query = (
            sa.select(*keyed, *self.constants, *self.group_also, *self.columns)
            .select_from(self.table)
            .where(_within(self.moment, windows), *self.condition)
            .group_by(*key, *self.group_also)
        )
        return query if tenant_id is None else query.where(self.tenant == tenant_id)


def _union(
    plan: _Plan, group: Group, tenant_id: int | None, raw: list[_Source], rollup: Callable[[str], _Source]
) -> sa.Subquery:
    """The raw sources over the plan's raw parts and the rollup's hours and days, as one subquery."""
    selects = [source.select(plan.raw, group, tenant_id) for source in raw if plan.raw]
    for granularity, windows in (("hour", plan.hours), ("day", plan.days)):
        if windows:
            selects.append(rollup(granularity).select(windows, group, tenant_id))
    return sa.union_all(*selects).subquery()


_SUMMED = ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "cost", "slo_met")
_e, _t = usage_events.alias("e"), tenants.alias("t")
_RAW_USAGE = _Source(
    _e.outerjoin(_t, _t.c.id == _e.c.tenant_id),
    (
        sa.func.count().label("requests"),
        *(sa.func.sum(_e.c[name]).label(name) for name in _SUMMED[1:4]),
        sa.func.sum(_e.c.cost).label("cost"),
        sa.func.count().filter(sa.text(SLO_MET_SQL)).label("slo_met"),
    ),
    _e.c.tenant_id,
    _e.c.finished_at,
)
_RAW_REFUSALS = _Source(
    shed_events,
    (sa.func.count().label("n"),),
    shed_events.c.tenant_id,
    shed_events.c.at,
    group_also=(shed_events.c.reason,),
)
_RAW_LATENCIES = [
    _Source(
        _e,
        (sa.func.count().label("n"),),
        _e.c.tenant_id,
        _e.c.finished_at,
        condition=(_e.c[f"{metric}_s"].isnot(None),),
        group_also=(sa.func.weir_latency_bucket(_e.c[f"{metric}_s"]).label("bucket"),),
        constants=(sa.literal_column(f"'{metric}'").label("metric"),),
    )
    for metric in ("ttft", "tpot")
]


def _rolled_up(
    table: sa.Table, columns: tuple[sa.ColumnElement, ...], group_also: tuple = ()
) -> Callable[[str], _Source]:
    """The source of a rollup table at one granularity."""

    def source(granularity: str) -> _Source:
        return _Source(
            table,
            columns,
            table.c.tenant_id,
            table.c.period_start,
            (table.c.granularity == granularity,),
            group_also,
        )

    return source


_ROLLED_USAGE = _rolled_up(usage_rollups, tuple(sa.func.sum(usage_rollups.c[n]).label(n) for n in _SUMMED))
_ROLLED_REFUSALS = _rolled_up(
    shed_rollups, (sa.func.sum(shed_rollups.c.refusals).label("n"),), (shed_rollups.c.reason,)
)
_ROLLED_LATENCIES = _rolled_up(
    latency_rollups,
    (sa.func.sum(latency_rollups.c.requests).label("n"),),
    (latency_rollups.c.metric, latency_rollups.c.bucket),
)


async def _rows(db: AsyncEngine, query: sa.Select) -> list[sa.Row]:
    """``query``'s rows, on a connection of its own (so that several queries run at once)."""
    async with db.connect() as conn:
        return list((await conn.execute(query)).all())


async def _grouped(
    db: AsyncEngine, window: Window, group: Group, tenant_id: int | None = None
) -> dict[object, UsageFigures]:
    """Figures over ``window`` per group key (0 for "all", the tenant id, or the period's start); groups
    without requests or refusals are absent. The usage, refusal and latency queries run at once."""
    plan = _Plan.of(window, use_days=group != "hour")
    usage = _union(plan, group, tenant_id, [_RAW_USAGE], _ROLLED_USAGE)
    totals = sa.select(
        usage.c.k, *(sa.func.coalesce(sa.func.sum(usage.c[name]), 0).label(name) for name in _SUMMED)
    ).group_by(usage.c.k)
    shed = _union(plan, group, tenant_id, [_RAW_REFUSALS], _ROLLED_REFUSALS)
    refused = sa.select(shed.c.k, shed.c.reason, sa.func.sum(shed.c.n)).group_by(shed.c.k, shed.c.reason)
    latency = _union(plan, group, tenant_id, _RAW_LATENCIES, _ROLLED_LATENCIES)
    buckets = sa.select(latency.c.k, latency.c.metric, latency.c.bucket, sa.func.sum(latency.c.n)).group_by(
        latency.c.k, latency.c.metric, latency.c.bucket
    )
    total_rows, refused_rows, bucket_rows = await asyncio.gather(
        _rows(db, totals), _rows(db, refused), _rows(db, buckets)
    )
    refusals: dict[object, dict[str, int]] = {}
    for key, reason, count in refused_rows:
        refusals.setdefault(key, _no_refusals())[reason] = int(count)
    histograms: dict[tuple[object, str], list[int]] = {}
    for key, metric, bucket, count in bucket_rows:
        histograms.setdefault((key, metric), [0] * LATENCY_BUCKETS)[bucket] = int(count)
    figures = {}
    empty = [0] * LATENCY_BUCKETS
    for row in total_rows:
        if not row.requests:
            continue
        ttft, tpot = histograms.get((row.k, "ttft"), empty), histograms.get((row.k, "tpot"), empty)
        figures[row.k] = UsageFigures(
            requests=int(row.requests),
            prompt_tokens=int(row.prompt_tokens),
            cached_tokens=int(row.cached_tokens),
            output_tokens=int(row.output_tokens),
            cost_units=Decimal(row.cost),
            slo_met=int(row.slo_met),
            ttft_p50=percentile(ttft, 0.5),
            ttft_p99=percentile(ttft, 0.99),
            tpot_p50=percentile(tpot, 0.5),
            tpot_p99=percentile(tpot, 0.99),
            refusals=refusals.pop(row.k, _no_refusals()),
        )
    for key, counts in refusals.items():
        figures[key] = UsageFigures(refusals=counts)
    return figures


async def _costs(db: AsyncEngine, window: Window) -> dict[int, Decimal]:
    """Cost units per tenant over ``window`` (tenants without usage are absent)."""
    usage = _union(_Plan.of(window), "tenant", None, [_RAW_USAGE], _ROLLED_USAGE)
    query = sa.select(usage.c.k, sa.func.sum(usage.c.cost)).group_by(usage.c.k)
    return {tenant: Decimal(cost) for tenant, cost in await _rows(db, query)}


async def overview(db: AsyncEngine, window: Window, tenant_id: int | None = None) -> UsageFigures:
    """Usage, latency and refusals over ``window``, of one tenant or all."""
    await refresh_rollups(db)
    return (await _grouped(db, window, "all", tenant_id)).get(0, UsageFigures())


def _month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


async def tenant_table(db: AsyncEngine, window: Window) -> list[TenantFigures]:
    """Every tenant (by name) with its figures over ``window`` and its quota use now."""
    await refresh_rollups(db)
    now = datetime.now(UTC)
    query = (
        sa.select(tenants, quotas, quota_state.c.in_flight)
        .select_from(tenants.outerjoin(quotas).outerjoin(quota_state))
        .order_by(tenants.c.name)
    )
    rows, figures, last_minute, month = await asyncio.gather(
        _rows(db, query),
        _grouped(db, window, "tenant"),
        _costs(db, Window(now - timedelta(minutes=1), now)),
        _costs(db, Window(_month_start(now), now)),
    )
    nothing = UsageFigures()
    return [
        TenantFigures(
            tenant_id=row.id,
            name=row.name,
            status=row.status,
            weight=row.weight,
            ttft_target_s=row.ttft_target_s,
            tpot_target_s=row.tpot_target_s,
            figures=figures.get(row.id, nothing),
            cost_per_minute=row.cost_per_minute,
            cost_last_minute=last_minute.get(row.id, Decimal(0)),
            max_concurrency=row.max_concurrency,
            slots_held=row.in_flight or 0,
            monthly_budget=row.monthly_budget,
            spent_this_month=month.get(row.id, Decimal(0)),
        )
        for row in rows
    ]


def _step_size(step: Step) -> timedelta:
    if step not in ("hour", "day"):
        raise InvalidValue(f"step must be 'hour' or 'day', got {step!r}")
    return HOUR if step == "hour" else DAY


def series_length(window: Window, step: Step) -> int:
    """How many hours or UTC days of ``window`` a series has a point for (partial ones included)."""
    size = _step_size(step)
    return -((floor_to(window.since, size) - window.until) // size)


async def tenant_series(db: AsyncEngine, tenant_id: int, window: Window, step: Step) -> list[SeriesPoint]:
    """One point per hour or UTC day of ``window`` (every interval, empty ones too), at the interval's
    start (the first one at its hour or day, even when the window starts later); at most
    ``MAX_SERIES_POINTS`` of them, else ``InvalidValue``."""
    length = series_length(window, step)
    if length > MAX_SERIES_POINTS:
        raise InvalidValue(f"a series holds at most {MAX_SERIES_POINTS} {step}s, not {length}")
    await refresh_rollups(db)
    figures = await _grouped(db, window, step, tenant_id)
    size = _step_size(step)
    points, start = [], floor_to(window.since, size)
    while start < window.until:
        f = figures.get(start, UsageFigures())
        points.append(
            SeriesPoint(
                start, f.cost_units, f.requests, f.ttft_p50, f.ttft_p99, f.tpot_p50, f.tpot_p99, f.refusals
            )
        )
        start += size
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
