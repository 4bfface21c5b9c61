"""A scratch database for a benchmark: created on ``DATABASE_URL``'s server or Weir's embedded one,
migrated to head, and dropped afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator


async def _admin(server_url: str, statement: str) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    conn = await asyncpg.connect(
        make_url(server_url).set(drivername="postgresql").render_as_string(hide_password=False)
    )
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """The URL of a new database migrated to head; dropped (connections and all) on exit."""
    from tenants.db import database_url, upgrade_to_head, with_database

    server_url = database_url()
    name = f"weir_bench_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(server_url, f'CREATE DATABASE "{name}"'))
    try:
        url = with_database(server_url, name)
        upgrade_to_head(url)
        yield url
    finally:
        asyncio.run(_admin(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
