"""``weir demo``: a first tenant and API key, so that ``make run`` can be tried at once; with ``--traffic``, a
week of synthetic usage for a few tenants, so that the dashboard has something to show."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

DEMO_TENANT = "demo"


def _open_database() -> AsyncEngine:
    """An engine on the configured database, migrated to head; a one-line exit when it cannot be had."""
    from sqlalchemy.exc import SQLAlchemyError

    from tenants.db import DatabaseError, create_engine, database_url, upgrade_to_head

    try:
        url = database_url()
        upgrade_to_head(url)
        return create_engine(url)
    except (DatabaseError, SQLAlchemyError, OSError) as exc:
        raise SystemExit(f"weir demo: error: database: {exc}") from None


async def ensure_demo_tenant() -> int:
    """Create the tenant ``demo`` and a key for it unless any tenant exists; print the key once."""
    from sqlalchemy.exc import SQLAlchemyError

    from tenants.admin import create_key, create_tenant, list_tenants

    db = _open_database()
    try:
        existing = await list_tenants(db)
        if existing:
            names = ", ".join(t.name for t in existing)
            print(f"Tenants exist already ({names}); no demo key created. New key: weir key create TENANT")
            return 0
        await create_tenant(db, DEMO_TENANT)
        _, secret = await create_key(db, DEMO_TENANT)
    except SQLAlchemyError as exc:
        raise SystemExit(f"weir demo: error: database: {exc}") from None
    finally:
        await db.dispose()
    print(f"Created tenant '{DEMO_TENANT}' with an API key (shown only this once):\n\n    {secret}\n")
    print(f"    export OPENAI_API_KEY={secret}")
    return 0


async def seed_traffic(days: int, requests: int) -> int:
    """Create the traffic tenants of ``tenants.traffic.DEMO_TENANTS`` and ``requests`` requests (with
    refusals) over the last ``days`` days; refused when one of those tenants exists already."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy.exc import SQLAlchemyError

    from tenants.records import TenantsError
    from tenants.traffic import DEMO_TENANTS, fill

    if days < 1 or requests < 1:
        raise SystemExit("weir demo: error: --days and --requests must be positive")
    db = _open_database()
    until = datetime.now(UTC)
    try:
        usage, refusals = await fill(db, DEMO_TENANTS, until - timedelta(days=days), until, requests)
    except TenantsError as exc:
        raise SystemExit(
            f"weir demo: error: {exc} (--traffic fills a database without those tenants)"
        ) from None
    except SQLAlchemyError as exc:
        raise SystemExit(f"weir demo: error: database: {exc}") from None
    finally:
        await db.dispose()
    names = ", ".join(t.name for t in DEMO_TENANTS)
    print(f"Wrote {usage} requests and {refusals} refusals over the last {days} days for {names}.")
    print("Open /admin on `weir serve` to see them.")
    return 0
