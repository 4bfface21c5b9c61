"""Migrations: empty -> head -> empty -> head, one step down and up, and the schema matches
tenants/models.py."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from tenants.db import downgrade, upgrade_to_head, with_database
from tenants.models import metadata
from tests.fixtures.database import plain_dsn, run_admin

EXPECTED = {t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}


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
        assert tables == EXPECTED and "q.monthly_budget / 10" in acquire

        downgrade(url, "base")
        assert asyncio.run(_schema(url)) == ({}, None)

        upgrade_to_head(url)
        tables, acquire = asyncio.run(_schema(url))
        assert tables == EXPECTED and "(free_budget - p_need_cost) / 10" in acquire
    finally:
        run_admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
