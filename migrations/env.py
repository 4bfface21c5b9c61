"""Alembic environment: runs Weir's revisions over asyncpg against DATABASE_URL or the embedded server."""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from tenants.db import create_engine, database_url
from tenants.models import metadata

config = context.config
if config.config_file_name is not None and not config.attributes.get("database_url"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


# Several processes may start at once (``weir serve`` migrates on start): one migrates, the others wait
# for it and then find the schema at head. PostgreSQL's DDL is transactional, so all revisions of a run
# commit together or not at all.
MIGRATION_LOCK_KEY = 0x7765697200000001


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def _run_online() -> None:
    engine = create_engine(config.attributes.get("database_url") or database_url(), poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("weir db: error: offline (SQL script) migrations are not supported")
asyncio.run(_run_online())
