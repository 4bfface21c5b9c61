"""Read-side queries for the dashboard and billing: usage per day, latency percentiles, shed counts.

Every function takes a half-open UTC window ``[since, until)`` (``until`` defaults to now) and an optional
tenant id; days are UTC calendar days.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.models import shed_events, tenants, usage_events


@dataclass(frozen=True)
class DailyUsage:
    tenant_id: int
    tenant_name: str
    day: date
    model: str
    requests: int
    errors: int  # requests whose status is not "ok"
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost: Decimal


@dataclass(frozen=True)
class LatencyStats:
    """Percentiles over the window's requests that have the measurement (seconds); ``None`` if none."""

    tenant_id: int
    tenant_name: str
    requests: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    tpot_p99: float | None


@dataclass(frozen=True)
class ShedCount:
    tenant_id: int
    tenant_name: str
    reason: str
    count: int


_Row = TypeVar("_Row", "DailyUsage", "LatencyStats", "ShedCount")


def _window(column: sa.Column, since: datetime, until: datetime | None) -> sa.ColumnElement[bool]:
    return sa.and_(column >= since, column < (until or datetime.now(UTC)))


def _tenant_name(tenant_column: sa.Column) -> sa.ColumnElement[str]:
    """The tenant's name, or its id as text for events of a tenant that no longer exists."""
    name = sa.select(tenants.c.name).where(tenants.c.id == tenant_column).scalar_subquery()
    return sa.func.coalesce(name, sa.cast(tenant_column, sa.Text)).label("tenant_name")


async def _fetch(
    engine: AsyncEngine,
    query: sa.Select,
    tenant_column: sa.Column,
    tenant_id: int | None,
    row_type: type[_Row],
) -> list[_Row]:
    if tenant_id is not None:
        query = query.where(tenant_column == tenant_id)
    async with engine.connect() as conn:
        rows = (await conn.execute(query)).all()
    return [row_type(**row._mapping) for row in rows]


async def usage_by_day(
    engine: AsyncEngine, since: datetime, until: datetime | None = None, tenant_id: int | None = None
) -> list[DailyUsage]:
    """Requests, errors, tokens and cost per tenant, UTC day (of finishing) and model."""
    day = sa.cast(sa.func.timezone("UTC", usage_events.c.finished_at), sa.Date).label("day")
    query = (
        sa.select(
            usage_events.c.tenant_id,
            _tenant_name(usage_events.c.tenant_id),
            day,
            usage_events.c.model,
            sa.func.count().label("requests"),
            sa.func.count().filter(usage_events.c.status != "ok").label("errors"),
            sa.func.sum(usage_events.c.prompt_tokens).label("prompt_tokens"),
            sa.func.sum(usage_events.c.cached_tokens).label("cached_tokens"),
            sa.func.sum(usage_events.c.output_tokens).label("output_tokens"),
            sa.func.sum(usage_events.c.cost).label("cost"),
        )
        .where(_window(usage_events.c.finished_at, since, until))
        .group_by(usage_events.c.tenant_id, day, usage_events.c.model)
        .order_by(day, "tenant_name", usage_events.c.model)
    )
    return await _fetch(engine, query, usage_events.c.tenant_id, tenant_id, DailyUsage)


async def latency_percentiles(
    engine: AsyncEngine, since: datetime, until: datetime | None = None, tenant_id: int | None = None
) -> list[LatencyStats]:
    """p50/p90/p99 of time to first token and mean time per output token, per tenant."""
    columns = []
    for metric in ("ttft", "tpot"):
        for q in (50, 90, 99):
            columns.append(
                sa.func.percentile_cont(q / 100)
                .within_group(usage_events.c[f"{metric}_s"])
                .label(f"{metric}_p{q}")
            )
    query = (
        sa.select(
            usage_events.c.tenant_id,
            _tenant_name(usage_events.c.tenant_id),
            sa.func.count().label("requests"),
            *columns,
        )
        .where(_window(usage_events.c.finished_at, since, until))
        .group_by(usage_events.c.tenant_id)
        .order_by("tenant_name")
    )
    return await _fetch(engine, query, usage_events.c.tenant_id, tenant_id, LatencyStats)


async def shed_counts(
    engine: AsyncEngine, since: datetime, until: datetime | None = None, tenant_id: int | None = None
) -> list[ShedCount]:
    """Refused requests per tenant and reason."""
    query = (
        sa.select(
            shed_events.c.tenant_id,
            _tenant_name(shed_events.c.tenant_id),
            shed_events.c.reason,
            sa.func.count().label("count"),
        )
        .where(_window(shed_events.c.at, since, until))
        .group_by(shed_events.c.tenant_id, shed_events.c.reason)
        .order_by("tenant_name", shed_events.c.reason)
    )
    return await _fetch(engine, query, shed_events.c.tenant_id, tenant_id, ShedCount)
