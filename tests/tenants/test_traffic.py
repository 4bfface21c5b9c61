"""Synthetic traffic: a plausible week lands in the ledger and the rollups, and ``weir demo --traffic``
fills a fresh database once."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa

from tenants.records import Conflict
from tenants.reporting import Window, overview, tenant_table
from tenants.traffic import DEMO_TENANTS, fill, load
from tests.tenants.test_cli import _env
from tests.tenants.test_cli import weir as run_weir

UNTIL = datetime(2026, 6, 8, tzinfo=UTC)  # a Monday: the week before is five weekdays and a weekend


async def test_a_week_of_traffic(db_engine):
    since = UNTIL - timedelta(days=7)
    usage, refusals = await fill(db_engine, DEMO_TENANTS, since, UNTIL, 6000, seed=3)
    assert usage == 6000 and refusals > 0
    async with db_engine.connect() as conn:
        rows = (await conn.execute(sa.text("SELECT * FROM usage_events"))).all()
        marks = (await conn.execute(sa.text("SELECT count(*) FROM rollup_marks"))).scalar()
        reasons = (await conn.execute(sa.text("SELECT tenant_id, reason FROM shed_events"))).all()
    assert len(rows) == 6000 and marks == 0
    for row in rows:
        assert since <= row.finished_at < UNTIL and row.started_at <= row.finished_at
        assert 0 <= row.cached_tokens <= row.prompt_tokens
        assert (
            row.cost
            == row.prompt_tokens
            - row.cached_tokens
            + Decimal("0.1") * row.cached_tokens
            + 2 * row.output_tokens
        )
    by_hour = Counter(row.finished_at.hour for row in rows)
    assert by_hour[14] > 3 * by_hour[3]  # busy afternoons, quiet nights
    assert sum(load(row.finished_at) for row in rows) / len(rows) > 0.5

    table = {t.name: t for t in await tenant_table(db_engine, Window(since, UNTIL))}
    assert set(table) == {t.name for t in DEMO_TENANTS}
    assert table["acme"].figures.requests > table["umbrella"].figures.requests
    names = {t.tenant_id: t.name for t in table.values()}
    allowed = {t.name: set(t.refusals) for t in DEMO_TENANTS}
    assert all(reason in allowed[names[tenant_id]] for tenant_id, reason in reasons)
    week = await overview(db_engine, Window(since, UNTIL))
    assert week.requests == 6000 and 0 < week.slo_attainment < 1
    with pytest.raises(Conflict):
        await fill(db_engine, DEMO_TENANTS, since, UNTIL, 10)


async def test_demo_traffic_command(database_url, tmp_path):
    env = _env(tmp_path / "state", database_url)
    done = await asyncio.to_thread(run_weir, env, "demo", "--traffic", "--requests", "800", "--days", "2")
    assert done.returncode == 0, done.stderr
    assert "Wrote 800 requests" in done.stdout
    again = await asyncio.to_thread(run_weir, env, "demo", "--traffic", "--requests", "10")
    assert again.returncode == 1 and "exists" in again.stderr and "Traceback" not in again.stderr
    bad = await asyncio.to_thread(run_weir, env, "demo", "--traffic", "--requests", "0")
    assert bad.returncode == 1 and "must be positive" in bad.stderr
