"""``weir demo``: a first tenant and API key, so that ``make run`` can be tried at once."""

from __future__ import annotations

DEMO_TENANT = "demo"


async def ensure_demo_tenant() -> int:
    """Create the tenant ``demo`` and a key for it unless any tenant exists; print the key once."""
    from sqlalchemy.exc import SQLAlchemyError

    from tenants.admin import create_key, create_tenant, list_tenants
    from tenants.db import DatabaseError, create_engine, database_url, upgrade_to_head

    try:
        url = database_url()
        upgrade_to_head(url)
        db = create_engine(url)
    except (DatabaseError, SQLAlchemyError, OSError) as exc:
        raise SystemExit(f"weir demo: error: database: {exc}") from None
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
