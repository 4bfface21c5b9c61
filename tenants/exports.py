"""Billing exports: usage rows per request, hour or UTC day, streamed as CSV, JSON Lines or FOCUS 1.2 CSV.

Rows come from the ledger (``request``) or the rollups (``hour``, ``day``; refreshed first), in a
server-side cursor, and the writers yield text a batch of rows at a time: an export is never held whole in
memory. docs/billing.md describes the formats, the row ids and when an interval is closed.
"""

from __future__ import annotations

import csv
import io
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Literal, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.models import api_keys, tenants, usage_events, usage_rollups
from tenants.records import InvalidValue
from tenants.rollups import DAY, HOUR, floor_to, refresh_rollups

Granularity = Literal["request", "hour", "day"]
GRANULARITIES: tuple[Granularity, ...] = ("request", "hour", "day")
COLUMNS = (
    "id",
    "tenant",
    "key_prefix",
    "model",
    "period_start",
    "period_end",
    "closed",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "cost_units",
)
CLOSE_AFTER = timedelta(minutes=5)  # an interval is closed this long after its end
_ROW_NAMESPACE = uuid.UUID("6f1d8a52-3c37-4c8e-9a55-0b5e2f61c0de")
_BATCH = 2000


class ExportRow(NamedTuple):
    """One row of an export (COLUMNS); ``key_prefix`` is empty for usage without a key."""

    id: str
    tenant: str
    key_prefix: str
    model: str
    period_start: datetime
    period_end: datetime
    closed: bool
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    cost_units: Decimal
    tenant_id: int
    key_id: int | None


def row_id(granularity: Granularity, tenant_id: int, key_id: int | None, model: str, start: datetime) -> str:
    """The stable id of an interval's row: the same in every export of that interval."""
    name = f"{granularity}/{tenant_id}/{'' if key_id is None else key_id}/{model}/{start.isoformat()}"
    return str(uuid.uuid5(_ROW_NAMESPACE, name))


def check_range(since: datetime, until: datetime, granularity: str) -> None:
    """``InvalidValue`` unless the range is aware, non-empty and, for ``hour``/``day``, on whole intervals."""
    if granularity not in GRANULARITIES:
        raise InvalidValue(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    for name, moment in (("since", since), ("until", until)):
        if moment.tzinfo is None:
            raise InvalidValue(f"{name} must have a time zone (UTC), got {moment!r}")
        if granularity != "request":
            step = HOUR if granularity == "hour" else DAY
            if floor_to(moment.astimezone(UTC), step) != moment:
                raise InvalidValue(f"{name} must be on a whole {granularity} (UTC) for that granularity")
    if since >= until:
        raise InvalidValue("until must be after since")


def _names(tenant_id: sa.ColumnElement) -> tuple[sa.ColumnElement, sa.ColumnElement]:
    """The tenant's name (its id for a tenant that is gone) and the key's prefix ("" without a key)."""
    return sa.func.coalesce(tenants.c.name, sa.cast(tenant_id, sa.Text)), sa.func.coalesce(
        api_keys.c.prefix, ""
    )


def _request_query(since: datetime, until: datetime, tenant_id: int | None) -> sa.Select:
    e = usage_events.c
    tenant, prefix = _names(e.tenant_id)
    query = (
        sa.select(
            e.request_id,
            tenant,
            prefix,
            e.model,
            e.started_at,
            e.finished_at,
            e.prompt_tokens,
            e.cached_tokens,
            e.output_tokens,
            e.cost,
            e.tenant_id,
            e.key_id,
        )
        .select_from(
            usage_events.outerjoin(tenants, tenants.c.id == e.tenant_id).outerjoin(
                api_keys, api_keys.c.id == e.key_id
            )
        )
        .where(e.finished_at >= since, e.finished_at < until)
        .order_by(e.finished_at, e.request_id)
    )
    return query if tenant_id is None else query.where(e.tenant_id == tenant_id)


def _rollup_query(since: datetime, until: datetime, granularity: str, tenant_id: int | None) -> sa.Select:
    r = usage_rollups.c
    tenant, prefix = _names(r.tenant_id)
    query = (
        sa.select(
            tenant,
            prefix,
            r.model,
            r.period_start,
            r.requests,
            r.prompt_tokens,
            r.cached_tokens,
            r.output_tokens,
            r.cost,
            r.tenant_id,
            r.key_id,
        )
        .select_from(
            usage_rollups.outerjoin(tenants, tenants.c.id == r.tenant_id).outerjoin(
                api_keys, api_keys.c.id == r.key_id
            )
        )
        .where(r.granularity == granularity, r.period_start >= since, r.period_start < until)
        .order_by(r.period_start, r.tenant_id, r.key_id.nulls_first(), r.model)
    )
    return query if tenant_id is None else query.where(r.tenant_id == tenant_id)


async def export_rows(
    db: AsyncEngine,
    since: datetime,
    until: datetime,
    granularity: Granularity,
    tenant_id: int | None = None,
) -> AsyncIterator[ExportRow]:
    """The export's rows in time order: each request that finished in ``[since, until)``, or each hour or
    day starting in it (per tenant, key and model, only those with requests)."""
    check_range(since, until, granularity)
    if granularity == "request":
        query = _request_query(since, until, tenant_id)
    else:
        await refresh_rollups(db)
        query = _rollup_query(since, until, granularity, tenant_id)
    size = HOUR if granularity == "hour" else DAY
    closed_before = datetime.now(UTC) - CLOSE_AFTER
    async with db.connect() as conn:
        result = await conn.stream(query.execution_options(yield_per=_BATCH))
        async for rows in result.partitions():
            for row in rows:
                if granularity == "request":
                    rid, tenant, prefix, model, start, end, prompt, cached, output, cost, tid, kid = row
                    yield ExportRow(
                        rid,
                        tenant,
                        prefix,
                        model,
                        start,
                        end,
                        True,
                        1,
                        prompt,
                        cached,
                        output,
                        cost,
                        tid,
                        kid,
                    )
                else:
                    tenant, prefix, model, start, requests, prompt, cached, output, cost, tid, kid = row
                    end = start + size
                    yield ExportRow(
                        row_id(granularity, tid, kid, model, start),
                        tenant,
                        prefix,
                        model,
                        start,
                        end,
                        end <= closed_before,
                        requests,
                        prompt,
                        cached,
                        output,
                        cost,
                        tid,
                        kid,
                    )


def _moment(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _fields(row: ExportRow) -> tuple:
    return (
        row.id,
        row.tenant,
        row.key_prefix,
        row.model,
        _moment(row.period_start),
        _moment(row.period_end),
        "true" if row.closed else "false",
        row.requests,
        row.prompt_tokens,
        row.cached_tokens,
        row.output_tokens,
        str(row.cost_units),
    )


async def _csv(header: Iterable[str], rows: AsyncIterator[tuple]) -> AsyncIterator[str]:
    """CSV text (RFC 4180, CRLF line ends): the header, then a chunk per batch of rows."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    count = 0
    async for fields in rows:
        writer.writerow(fields)
        count += 1
        if count % _BATCH == 0:
            yield buffer.getvalue()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue()


async def _plain(rows: AsyncIterator[ExportRow]) -> AsyncIterator[tuple]:
    async for row in rows:
        yield _fields(row)


def csv_chunks(rows: AsyncIterator[ExportRow]) -> AsyncIterator[str]:
    """The export as CSV with the header COLUMNS (times in ISO 8601 UTC, ``closed`` true/false)."""
    return _csv(COLUMNS, _plain(rows))


async def jsonl_chunks(rows: AsyncIterator[ExportRow]) -> AsyncIterator[str]:
    """The export as JSON Lines: one object per row with the CSV's fields (``cost_units`` a decimal
    string, so that no digit is lost; ``closed`` a boolean; counts are numbers)."""
    lines: list[str] = []
    async for row in rows:
        fields = dict(zip(COLUMNS, _fields(row), strict=True))
        fields["closed"] = row.closed
        lines.append(json.dumps(fields, separators=(",", ":")))
        if len(lines) == _BATCH:
            yield "\n".join(lines) + "\n"
            lines.clear()
    if lines:
        yield "\n".join(lines) + "\n"


@dataclass(frozen=True)
class FocusSettings:
    """What FOCUS rows need beyond usage: the price of a cost unit in the billing currency, who issues
    the bill, and the weights that share a row's cost among its token kinds (engine/cost.py's defaults)."""

    price_per_cost_unit: Decimal = Decimal("0.000002")
    currency: str = "USD"
    provider: str = "Weir"
    weights: tuple[Decimal, Decimal, Decimal] = (Decimal(1), Decimal("0.1"), Decimal(2))

    @classmethod
    def from_env(cls, price: str | None = None) -> FocusSettings:
        """``price`` or ``WEIR_PRICE_PER_COST_UNIT``, ``WEIR_BILLING_CURRENCY``, ``WEIR_BILLING_PROVIDER``."""
        raw = price if price is not None else os.environ.get("WEIR_PRICE_PER_COST_UNIT")
        values: dict = {}
        if raw is not None:
            try:
                values["price_per_cost_unit"] = Decimal(raw)
            except InvalidOperation:
                raise InvalidValue(f"price per cost unit must be a decimal number, got {raw!r}") from None
            if not values["price_per_cost_unit"].is_finite() or values["price_per_cost_unit"] < 0:
                raise InvalidValue(f"price per cost unit must be a finite number >= 0, got {raw!r}")
        for name, variable in (("currency", "WEIR_BILLING_CURRENCY"), ("provider", "WEIR_BILLING_PROVIDER")):
            if os.environ.get(variable):
                values[name] = os.environ[variable]
        return cls(**values)


FOCUS_COLUMNS = (
    "BilledCost",
    "EffectiveCost",
    "ListCost",
    "ContractedCost",
    "BillingCurrency",
    "BillingAccountId",
    "BillingAccountName",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ChargeCategory",
    "ChargeClass",
    "ChargeDescription",
    "PricingQuantity",
    "PricingUnit",
    "ConsumedQuantity",
    "ConsumedUnit",
    "SubAccountId",
    "SkuId",
    "ResourceId",
    "ServiceCategory",
    "ServiceName",
    "ProviderName",
    "PublisherName",
    "InvoiceIssuerName",
    "x_RowId",
    "x_Closed",
)
TOKEN_KINDS = (
    ("input-tokens", "uncached prompt"),
    ("cached-input-tokens", "cached prompt"),
    ("output-tokens", "output"),
)
_MICRO = Decimal("0.000001")


def split_cost(row: ExportRow, weights: tuple[Decimal, Decimal, Decimal]) -> list[Decimal]:
    """The row's cost units shared among uncached prompt, cached prompt and output tokens in proportion to
    ``weights * tokens``, in micro cost units; the shares add up to the row's cost exactly (the output
    share takes the rounding)."""
    tokens = (row.prompt_tokens - row.cached_tokens, row.cached_tokens, row.output_tokens)
    weighted = [w * t for w, t in zip(weights, tokens, strict=True)]
    total = sum(weighted)
    if total == 0:
        return [Decimal(0), Decimal(0), row.cost_units]
    first = [(row.cost_units * share / total).quantize(_MICRO) for share in weighted[:2]]
    return [*first, row.cost_units - sum(first)]


def _month_bounds(moment: datetime) -> tuple[datetime, datetime]:
    start = moment.astimezone(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (start + timedelta(days=32)).replace(day=1)
    return start, end


async def _focus_rows(rows: AsyncIterator[ExportRow], settings: FocusSettings) -> AsyncIterator[tuple]:
    for_price = settings.price_per_cost_unit
    async for row in rows:
        month_start, month_end = _month_bounds(row.period_start)
        tokens = (row.prompt_tokens - row.cached_tokens, row.cached_tokens, row.output_tokens)
        shares = split_cost(row, settings.weights)
        for (sku, what), quantity, units in zip(TOKEN_KINDS, tokens, shares, strict=True):
            cost = str(units * for_price)
            yield (
                cost,
                cost,
                cost,
                cost,
                settings.currency,
                row.tenant_id,
                row.tenant,
                _moment(month_start),
                _moment(month_end),
                _moment(row.period_start),
                _moment(row.period_end),
                "Usage",
                "",
                f"{row.model} {what} tokens",
                str(units),
                "Cost Units",
                quantity,
                "Tokens",
                row.key_prefix,
                sku,
                row.model,
                "AI and Machine Learning",
                settings.provider,
                settings.provider,
                settings.provider,
                settings.provider,
                f"{row.id}/{sku}",
                "true" if row.closed else "false",
            )


def focus_chunks(rows: AsyncIterator[ExportRow], settings: FocusSettings) -> AsyncIterator[str]:
    """The export as FOCUS 1.2 CSV: three charge rows per export row, one per token kind."""
    return _csv(FOCUS_COLUMNS, _focus_rows(rows, settings))
