"""Migrations: empty -> head -> empty -> head, and the schema matches tenants/models.py."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg

from tenants.db import downgrade, upgrade_to_head, with_database
from tenants.models import metadata
from tests.fixtures.database import plain_dsn, run_admin


async def _columns(url: str) -> dict[str, set[str]]:
    conn = await asyncpg.connect(plain_dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'"
        )
        functions = await conn.fetchval(
            "SELECT count(*) FROM pg_proc "
            "WHERE proname LIKE 'weir\\_%' AND pronamespace = 'public'::regnamespace"
        )
    finally:
        await conn.close()
    tables: dict[str, set[str]] = {}
    for row in rows:
        tables.setdefault(row["table_name"], set()).add(row["column_name"])
    tables.pop("alembic_version", None)
    if functions:
        tables["functions"] = {str(functions)}
    return tables


async def _upgrade_from_async_code(url: str) -> None:
    upgrade_to_head(url)  # inside a running loop: Alembic gets a thread of its own


def test_upgrade_downgrade_upgrade(pg_server_url):
    name = f"weir_migrate_{uuid.uuid4().hex[:8]}"
    run_admin(pg_server_url, f'CREATE DATABASE "{name}"')
    url = with_database(pg_server_url, name)
    try:
        asyncio.run(_upgrade_from_async_code(url))
        expected = {t.name: {c.name for c in t.columns} for t in metadata.sorted_tables}
        head = asyncio.run(_columns(url))
        assert head.pop("functions") == {"2"}
        assert head == expected
        downgrade(url, "base")
        assert asyncio.run(_columns(url)) == {}
        upgrade_to_head(url)
        again = asyncio.run(_columns(url))
        again.pop("functions")
        assert again == expected
    finally:
        run_admin(pg_server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
