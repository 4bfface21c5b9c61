"""Migrations: empty -> head -> empty -> head, one step down and up, and the schema matches
tenants/models.py."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import asyncpg

from tenants.db import downgrade, upgrade_to_head, with_database
from tenants.models import metadata
from tests.fixtures.database import plain_dsn, run_admin

EXPECTED = {t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}
BEFORE_ROLLUPS = {name: columns for name, columns in EXPECTED.items() if "rollup" not in name}


async def _schema(url: str) -> tuple[dict[str, set[str]], str | None]:
    """The public tables with their columns, and the definition of weir_quota_acquire (None if absent)."""
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
        )
        acquire = await conn.fetchval(
            "SELECT pg_get_functiondef(oid) FROM pg_proc WHERE proname = 'weir_quota_acquire'"
        )
    finally:
        await conn.close()
    tables: dict[str, set[str]] = {}
    for row in rows:
        tables.setdefault(row["table_name"], set()).add(row["column_name"])
    tables.pop("alembic_version", None)
    return tables, acquire


async def _upgrade_from_async_code(url: str) -> None:
    upgrade_to_head(url)  # inside a running loop: Alembic gets a thread of its own


def test_upgrade_downgrade_upgrade(pg_server_url):
    name = f"weir_migrate_{uuid.uuid4().hex[:8]}"
    run_admin(pg_server_url, f'CREATE DATABASE "{name}"')
    url = with_database(pg_server_url, name)
    try:
        asyncio.run(_upgrade_from_async_code(url))
        tables, acquire = asyncio.run(_schema(url))
        assert tables == EXPECTED
        assert "(free_budget - p_need_cost) / 10" in acquire  # revision 0002's slice caps

        downgrade(url, "0001")
        tables, acquire = asyncio.run(_schema(url))
        assert tables == BEFORE_ROLLUPS and "q.monthly_budget / 10" in acquire

        downgrade(url, "base")
        assert asyncio.run(_schema(url)) == ({}, None)

        upgrade_to_head(url)
        tables, acquire = asyncio.run(_schema(url))
        assert tables == EXPECTED and "(free_budget - p_need_cost) / 10" in acquire
    finally:
        run_admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _costs_through_upgrade(url: str) -> tuple[list, list, list]:
    """Costs of a ledger written before exact costs, after upgrading to head, and the rollups built from
    them by the first refresh."""
    from tenants.db import create_engine
    from tenants.rollups import refresh_rollups

    conn = await asyncpg.connect(plain_dsn(url))
    try:
        for n, cost in enumerate((0.1 + 0.2, 1 / 3, 2.0)):
            await conn.execute(
                "INSERT INTO usage_events (request_id, tenant_id, model, prompt_tokens, cached_tokens, "
                "output_tokens, cost, status, started_at, finished_at) "
                "VALUES ($1, 1, 'm', 1, 0, 1, $2, 'ok', now(), now())",
                f"req-{n}",
                cost,
            )
        await asyncio.to_thread(upgrade_to_head, url)
        costs = [row["cost"] for row in await conn.fetch("SELECT cost FROM usage_events ORDER BY request_id")]
        engine = create_engine(url)
        try:
            await refresh_rollups(engine)
        finally:
            await engine.dispose()
        rollups = await conn.fetch("SELECT granularity, requests, cost FROM usage_rollups ORDER BY 1")
        marks = await conn.fetch("SELECT * FROM rollup_marks")
    finally:
        await conn.close()
    return costs, [tuple(row) for row in rollups], marks


def test_exact_costs_and_rollups_of_an_existing_ledger(pg_server_url):
    name = f"weir_migrate_{uuid.uuid4().hex[:8]}"
    run_admin(pg_server_url, f'CREATE DATABASE "{name}"')
    url = with_database(pg_server_url, name)
    try:
        upgrade_to_head(url)
        downgrade(url, "0002")
        costs, rollups, marks = asyncio.run(_costs_through_upgrade(url))
        assert costs == [Decimal("0.3"), Decimal("0.333333"), Decimal(2)]
        total = Decimal("2.633333")
        assert rollups == [("day", 3, total), ("hour", 3, total)] and marks == []
    finally:
        run_admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
