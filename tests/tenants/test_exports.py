"""Billing exports: every format's totals equal the ledger's for the range and tenant, row ids are stable
across re-exports, and ``weir usage export`` writes the same bytes and refuses bad input in one line."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from tenants.exports import (
    COLUMNS,
    FOCUS_COLUMNS,
    FocusSettings,
    csv_chunks,
    export_rows,
    focus_chunks,
    jsonl_chunks,
)
from tenants.records import InvalidValue
from tenants.usage import write_events
from tests.tenants.ledger_data import START, ledger_tenants, shed_events, usage_events
from tests.tenants.test_cli import _env
from tests.tenants.test_cli import weir as run_weir

TOKENS = ("prompt_tokens", "cached_tokens", "output_tokens")


async def _text(chunks) -> str:
    return "".join([chunk async for chunk in chunks])


def _ledger_totals(events, since, until, tenant_id=None) -> dict:
    chosen = [e for e in events if since <= e.finished_at < until and tenant_id in (None, e.tenant_id)]
    totals = {name: sum(getattr(e, name) for e in chosen) for name in TOKENS}
    return totals | {"requests": len(chosen), "cost_units": sum((e.cost for e in chosen), Decimal(0))}


def _csv_totals(rows: list[dict]) -> dict:
    totals = {name: sum(int(row[name]) for row in rows) for name in (*TOKENS, "requests")}
    return totals | {"cost_units": sum((Decimal(row["cost_units"]) for row in rows), Decimal(0))}


@pytest.fixture
async def ledger(db_engine):
    rng = random.Random(5)
    targets, tenants = await ledger_tenants(db_engine)
    events = usage_events(rng, tenants, 1200)
    await write_events(db_engine, events + shed_events(rng, tenants, 50))
    return events, [t for t, _ in tenants]


async def test_csv_and_jsonl_totals_equal_the_ledger_and_ids_are_stable(db_engine, ledger):
    events, tenant_ids = ledger
    since, until = START + timedelta(days=1), START + timedelta(days=3)
    for granularity in ("request", "hour", "day"):
        for tenant_id in (None, tenant_ids[1]):
            text = await _text(csv_chunks(export_rows(db_engine, since, until, granularity, tenant_id)))
            assert text.splitlines()[0] == ",".join(COLUMNS)
            rows = list(csv.DictReader(io.StringIO(text)))
            assert _csv_totals(rows) == _ledger_totals(events, since, until, tenant_id), granularity
            assert len({row["id"] for row in rows}) == len(rows)
            lines = await _text(jsonl_chunks(export_rows(db_engine, since, until, granularity, tenant_id)))
            objects = [json.loads(line) for line in lines.splitlines()]
            assert [list(o) for o in objects[:1]] == [list(COLUMNS)]
            assert [
                {k: str(v).lower() if k == "closed" else str(v) for k, v in o.items()} for o in objects
            ] == rows
    rng = random.Random(11)
    for _ in range(8):  # random ranges on whole hours or days, random tenant
        granularity = rng.choice(["request", "hour", "day"])
        step = timedelta(days=1) if granularity == "day" else timedelta(hours=1)
        start = START - step + rng.randint(0, 4 * 24 * 3600 // int(step.total_seconds())) * step
        end = start + rng.randint(1, 40) * step
        tenant_id = rng.choice([None, *tenant_ids])
        text = await _text(csv_chunks(export_rows(db_engine, start, end, granularity, tenant_id)))
        rows = list(csv.DictReader(io.StringIO(text)))
        assert _csv_totals(rows) == _ledger_totals(events, start, end, tenant_id), (granularity, start, end)
    # the same interval gets the same id when exported again, and inside a wider range
    narrow = await _text(csv_chunks(export_rows(db_engine, since, since + timedelta(hours=1), "hour")))
    wide = await _text(csv_chunks(export_rows(db_engine, since - timedelta(hours=5), until, "hour")))
    assert set(narrow.splitlines()[1:]) <= set(wide.splitlines()[1:])
    by_request = {e.request_id: e for e in events}
    async for row in export_rows(db_engine, since, until, "request"):
        event = by_request[row.id]
        assert (row.period_start, row.period_end, row.closed) == (event.started_at, event.finished_at, True)


async def test_closed_flag_and_late_events(db_engine):
    from tenants.admin import create_tenant
    from tenants.usage import UsageEvent

    tenant = await create_tenant(db_engine, "late")
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)

    def event(n: int, at: datetime) -> UsageEvent:
        return UsageEvent(
            f"late-{n}", tenant.id, None, "m", 10, 0, 5, 20.5, "ok", "stop", 0, 0.1, 0.01, 1, at, at
        )

    await write_events(db_engine, [event(1, now - timedelta(hours=2)), event(2, now + timedelta(seconds=1))])
    rows = [
        r async for r in export_rows(db_engine, now - timedelta(hours=2), now + timedelta(hours=1), "hour")
    ]
    assert [(r.requests, r.closed) for r in rows] == [(1, True), (1, False)]
    await write_events(db_engine, [event(3, now - timedelta(hours=2))])  # replayed late into a closed hour
    again = [
        r async for r in export_rows(db_engine, now - timedelta(hours=2), now + timedelta(hours=1), "hour")
    ]
    assert [(r.id, r.requests, r.cost_units) for r in again] == [
        (rows[0].id, 2, Decimal("41")),
        (rows[1].id, 1, Decimal("20.5")),
    ]


async def test_focus_rows_share_each_rows_cost_exactly(db_engine, ledger):
    events, _ = ledger
    since, until = START, START + timedelta(days=4)
    settings = FocusSettings(price_per_cost_unit=Decimal("0.0000025"), currency="EUR", provider="Acme AI")
    text = await _text(focus_chunks(export_rows(db_engine, since, until, "day"), settings))
    assert text.splitlines()[0] == ",".join(FOCUS_COLUMNS)
    rows = list(csv.DictReader(io.StringIO(text)))
    plain = {r.id: r async for r in export_rows(db_engine, since, until, "day")}
    assert len(rows) == 3 * len(plain)
    cost, consumed = defaultdict(Decimal), defaultdict(int)
    for row in rows:
        row_id, sku = row["x_RowId"].rsplit("/", 1)
        cost[row_id] += Decimal(row["PricingQuantity"])
        consumed[sku] += int(row["ConsumedQuantity"])
        assert Decimal(row["BilledCost"]) == Decimal(row["PricingQuantity"]) * settings.price_per_cost_unit
        assert row["BillingCurrency"] == "EUR" and row["ChargeCategory"] == "Usage"
        assert row["BillingPeriodStart"] <= row["ChargePeriodStart"] < row["BillingPeriodEnd"]
    assert cost == {row_id: r.cost_units for row_id, r in plain.items()}
    totals = _ledger_totals(events, since, until)
    assert consumed == {
        "input-tokens": totals["prompt_tokens"] - totals["cached_tokens"],
        "cached-input-tokens": totals["cached_tokens"],
        "output-tokens": totals["output_tokens"],
    }
    assert sum(cost.values()) == totals["cost_units"]


async def test_bad_ranges_are_refused(db_engine):
    since = datetime(2026, 6, 1, tzinfo=UTC)
    for until, granularity in (
        (since, "request"),
        (since + timedelta(minutes=30), "hour"),
        (since + timedelta(hours=3), "day"),
        (since + timedelta(days=1), "week"),
    ):
        with pytest.raises(InvalidValue):
            [row async for row in export_rows(db_engine, since, until, granularity)]


async def test_cli_export_writes_the_stream_and_refuses_bad_input(database_url, ledger, tmp_path):
    env = _env(tmp_path / "state", database_url)

    def weir(*args: str):
        return run_weir(env, *args)

    out = tmp_path / "june.csv"
    done = await asyncio.to_thread(
        weir,
        "usage",
        "export",
        "--format",
        "csv",
        "--since",
        "2026-05-31",
        "--until",
        "2026-06-02",
        "--granularity",
        "hour",
        "--tenant",
        "globex",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(out.open(newline="")))
    assert rows and {row["tenant"] for row in rows} == {"globex"}
    printed = await asyncio.to_thread(
        weir,
        "usage",
        "export",
        "--format",
        "focus",
        "--since",
        "2026-05-31",
        "--until",
        "2026-06-01",
        "--price",
        "0.5",
    )
    assert printed.returncode == 0 and printed.stdout.startswith(",".join(FOCUS_COLUMNS))
    for args, message in (
        (("--since", "2026-05-31T00:30", "--until", "2026-06-01", "--granularity", "hour"), "whole hour"),
        (("--since", "yesterday", "--until", "2026-06-01"), "expected a date"),
        (("--since", "2026-06-01", "--until", "2026-05-01"), "after since"),
        (("--since", "2026-05-01", "--until", "2026-06-01", "--tenant", "nobody"), "no tenant"),
        (
            ("--since", "2026-05-01", "--until", "2026-06-01", "--format", "focus", "--price", "cheap"),
            "decimal",
        ),
    ):
        failed = await asyncio.to_thread(weir, "usage", "export", *args)
        assert failed.returncode == 1 and message in failed.stderr and "Traceback" not in failed.stderr, args
        assert len(failed.stderr.strip().splitlines()) == 1
