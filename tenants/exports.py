"""Billing exports: usage rows per request, hour or UTC day, streamed as CSV, JSON Lines or FOCUS 1.2 CSV.

``export_rows`` selects an export's rows: from the ledger (``request``) or the rollups (``hour``, ``day``;
refreshed first). Iterated, it yields :class:`ExportRow` values; given to a writer (``csv_chunks``,
``jsonl_chunks``, ``focus_chunks``) it streams text that PostgreSQL formats itself (``COPY (SELECT ...)
TO STDOUT``), chunk by chunk through a small bounded queue, so an export is never held in memory and
Python never touches a single row. docs/billing.md describes the formats, the row ids and when an
interval is closed.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Literal, NamedTuple

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

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
_QUEUE_CHUNKS = 8  # COPY chunks (about 64 KiB each) buffered between PostgreSQL and the reader


class ExportRow(NamedTuple):
    """One row of an export (COLUMNS, then the tenant's and key's ids); ``key_prefix`` is empty for usage
    without a key."""

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


def _moment_sql(value: datetime) -> str:
    """A literal timestamptz (COPY takes no parameters; the text is our own, from an aware datetime)."""
    return f"'{value.astimezone(UTC).isoformat()}'::timestamptz"


def _iso_text(utc_timestamp: str) -> str:
    """SQL for a UTC timestamp (without time zone) as ISO 8601 text, ``2026-05-01T12:00:00.000000Z``."""
    return f"""to_char({utc_timestamp}, 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"""


def _utc_text(column: str) -> str:
    """SQL for a timestamptz as ISO 8601 UTC text (whatever the session's time zone)."""
    return _iso_text(f"{column} AT TIME ZONE 'UTC'")


_NAMES = "coalesce(t.name, {src}.tenant_id::text) AS tenant, coalesce(k.prefix, '') AS key_prefix"
_JOINS = "LEFT JOIN tenants AS t ON t.id = {src}.tenant_id LEFT JOIN api_keys AS k ON k.id = {src}.key_id"


@dataclass(frozen=True)
class Export:
    """An export's rows: ``async for`` gives :class:`ExportRow` values; the writers stream it as text."""

    db: AsyncEngine
    since: datetime
    until: datetime
    granularity: Granularity
    tenant_id: int | None

    def source(self, closed_before: datetime) -> tuple[str, str]:
        """The SELECT of the rows (columns COLUMNS + tenant_id, key_id) and its ORDER BY."""
        where = f"BETWEEN_SINCE >= {_moment_sql(self.since)} AND BETWEEN_UNTIL < {_moment_sql(self.until)}"
        if self.granularity == "request":
            where = where.replace("BETWEEN_SINCE", "e.finished_at").replace("BETWEEN_UNTIL", "e.finished_at")
            select = f"""
SELECT e.request_id AS id, {_NAMES.format(src="e")}, e.model, e.started_at AS period_start,
       e.finished_at AS period_end, true AS closed, 1 AS requests, e.prompt_tokens, e.cached_tokens,
       e.output_tokens, e.cost AS cost_units, e.tenant_id, e.key_id
FROM usage_events AS e {_JOINS.format(src="e")}
WHERE {where}{"" if self.tenant_id is None else f" AND e.tenant_id = {int(self.tenant_id)}"}"""
            return select, "period_end, id"
        step = "interval '1 hour'" if self.granularity == "hour" else "interval '24 hours'"
        where = where.replace("BETWEEN_SINCE", "r.period_start").replace("BETWEEN_UNTIL", "r.period_start")
        row_id = (
            f"md5(concat_ws('/', r.granularity, r.tenant_id, coalesce(r.key_id::text, ''), r.model, "
            f"{_utc_text('r.period_start')}))::uuid::text"
        )
        select = f"""
SELECT {row_id} AS id, {_NAMES.format(src="r")}, r.model, r.period_start,
       r.period_start + {step} AS period_end,
       r.period_start + {step} <= {_moment_sql(closed_before)} AS closed, r.requests, r.prompt_tokens,
       r.cached_tokens, r.output_tokens, r.cost AS cost_units, r.tenant_id, r.key_id
FROM usage_rollups AS r {_JOINS.format(src="r")}
WHERE r.granularity = '{self.granularity}' AND {where}
      {"" if self.tenant_id is None else f" AND r.tenant_id = {int(self.tenant_id)}"}"""
        return select, "period_start, tenant_id, key_id NULLS FIRST, model"

    async def _prepared(self) -> tuple[str, str]:
        if self.granularity != "request":
            await refresh_rollups(self.db)
        return self.source(datetime.now(UTC) - CLOSE_AFTER)

    async def __aiter__(self) -> AsyncIterator[ExportRow]:
        select, order = await self._prepared()
        query = sa.text(f"SELECT * FROM ({select}) AS x ORDER BY {order}")
        async with self.db.connect() as conn:
            result = await conn.stream(query.execution_options(yield_per=5000))
            async for row in result:
                yield ExportRow(*row)

    async def copy(self, formatted: str, then_by: str = "", **options: str) -> AsyncIterator[str]:
        """The text of ``COPY (formatted) TO STDOUT (FORMAT csv)`` as it arrives, where ``formatted`` selects
        from ``{rows}`` (the rows), ordered as the rows are and then by ``then_by``; ``options`` are COPY's
        (``delimiter``, ``quote``)."""
        select, order = await self._prepared()
        order += f", {then_by}" if then_by else ""
        query = f"{formatted.format(rows=f'({select}) AS x')} ORDER BY {order}"
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(_QUEUE_CHUNKS)
        decoder = codecs.getincrementaldecoder("utf-8")()
        async with self.db.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection

            async def produce() -> None:
                try:
                    await raw.copy_from_query(query, output=queue.put, format="csv", **options)
                finally:
                    await queue.put(None)

            task = asyncio.create_task(produce())
            try:
                while (chunk := await queue.get()) is not None:
                    yield decoder.decode(chunk)
                await task  # raises what the COPY raised
            finally:
                if not task.done():  # the reader went away: stop the COPY and drop the connection
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                    await conn.invalidate()


def export_rows(
    db: AsyncEngine,
    since: datetime,
    until: datetime,
    granularity: Granularity,
    tenant_id: int | None = None,
) -> Export:
    """The export of each request that finished in ``[since, until)``, or of each hour or day starting in
    it (per tenant, key and model, only those with requests), in time order; ``InvalidValue`` for a bad
    range (:func:`check_range`)."""
    check_range(since, until, granularity)
    return Export(db, since, until, granularity, tenant_id)


_CSV_FIELDS = (
    f"id, tenant, key_prefix, model, {_utc_text('period_start')}, {_utc_text('period_end')}, "
    "CASE WHEN closed THEN 'true' ELSE 'false' END, requests, prompt_tokens, cached_tokens, output_tokens, "
    "cost_units::text"
)


async def csv_chunks(rows: Export) -> AsyncIterator[str]:
    """The export as CSV with the header COLUMNS (times ISO 8601 UTC, ``closed`` true/false, CRLF-free)."""
    yield ",".join(COLUMNS) + "\n"
    async for chunk in rows.copy(f"SELECT {_CSV_FIELDS} FROM {{rows}}"):
        yield chunk


async def jsonl_chunks(rows: Export) -> AsyncIterator[str]:
    """The export as JSON Lines: one object per row with the CSV's fields in its order (``cost_units`` a
    decimal string, so that no digit is lost; ``closed`` a boolean; counts are numbers)."""
    fields = ", ".join(
        f"'{name}', {_utc_text(name) if name.startswith('period') else name}"
        for name in COLUMNS
        if name != "cost_units"
    )
    # one column, with CSV's delimiter and quote moved to control characters that JSON text never holds
    # raw, so that nothing is quoted
    query = f"SELECT json_build_object({fields}, 'cost_units', cost_units::text)::text FROM {{rows}}"
    async for chunk in rows.copy(query, delimiter="\x02", quote="\x01"):
        yield chunk


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
# Each export row becomes one FOCUS row per token kind: its SkuId, what ChargeDescription calls it.
TOKEN_KINDS = (
    ("input-tokens", "uncached prompt"),
    ("cached-input-tokens", "cached prompt"),
    ("output-tokens", "output"),
)


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _focus_query(settings: FocusSettings) -> str:
    """The FOCUS rows: a row's cost units are shared among its token kinds in proportion to weight times
    tokens, rounded (half away from zero) to micro cost units; the output share takes the rounding, so
    the shares add up to the row's cost exactly (all of it goes to output when no token is weighted)."""
    w_in, w_cached, w_out = (f"{w}::numeric" for w in settings.weights)
    price, who = f"{settings.price_per_cost_unit}::numeric", _text(settings.provider)
    weighted = (
        f"({w_in} * (prompt_tokens - cached_tokens) + {w_cached} * cached_tokens + {w_out} * output_tokens)"
    )
    share = f"CASE WHEN {weighted} = 0 THEN 0 ELSE round(cost_units * {{w}} * {{tokens}} / {weighted}, 6) END"
    first = share.format(w=w_in, tokens="(prompt_tokens - cached_tokens)")
    second = share.format(w=w_cached, tokens="cached_tokens")
    month = "date_trunc('month', s.period_start AT TIME ZONE 'UTC')"
    kinds = ", ".join(f"({n}, {_text(sku)}, {_text(what)})" for n, (sku, what) in enumerate(TOKEN_KINDS))
    return f"""
SELECT (s.units * {price})::text, (s.units * {price})::text, (s.units * {price})::text,
       (s.units * {price})::text, {_text(settings.currency)}, s.tenant_id, s.tenant,
       {_iso_text(month)}, {_iso_text(f"{month} + interval '1 month'")},
       {_utc_text("s.period_start")}, {_utc_text("s.period_end")}, 'Usage', NULL,
       s.model || ' ' || s.what || ' tokens', s.units::text, 'Cost Units', s.quantity, 'Tokens',
       s.key_prefix, s.sku, s.model, 'AI and Machine Learning', {who}, {who}, {who}, {who},
       s.id || '/' || s.sku, CASE WHEN s.closed THEN 'true' ELSE 'false' END
FROM (
    SELECT x.*, kind.n, kind.sku, kind.what,
           CASE kind.n WHEN 0 THEN prompt_tokens - cached_tokens WHEN 1 THEN cached_tokens
                ELSE output_tokens END AS quantity,
           CASE kind.n WHEN 0 THEN {first} WHEN 1 THEN {second}
                ELSE cost_units - ({first}) - ({second}) END AS units
    FROM {{rows}} CROSS JOIN (VALUES {kinds}) AS kind (n, sku, what)
) AS s"""


async def focus_chunks(rows: Export, settings: FocusSettings) -> AsyncIterator[str]:
    """The export as FOCUS 1.2 CSV: three charge rows per export row, one per token kind."""
    yield ",".join(FOCUS_COLUMNS) + "\n"
    async for chunk in rows.copy(_focus_query(settings), then_by="n"):
        yield chunk
