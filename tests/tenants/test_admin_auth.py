"""Tenant and key administration, and key authentication against a real PostgreSQL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tenants.admin import create_key, create_tenant, list_keys, revoke_key, set_tenant_status, update_tenant
from tenants.auth import KeyAuthenticator, RevokedKey, TenantSuspended, UnknownKey
from tenants.records import Conflict, InvalidValue, NotFound, Quotas


async def test_database_holds_no_secret(db_engine):
    tenant = await create_tenant(db_engine, "acme", quota=Quotas(cost_per_minute=1000))
    secrets = [(await create_key(db_engine, tenant.name))[1] for _ in range(3)]
    async with db_engine.connect() as conn:
        columns = (
            await conn.execute(
                sa.text(
                    "SELECT table_name, column_name FROM information_schema.columns "
                    "WHERE table_schema = 'public' AND data_type IN ('text', 'character varying', 'bytea')"
                )
            )
        ).all()
        assert ("api_keys", "prefix") in columns
        for table, column in columns:
            values = (await conn.execute(sa.text(f'SELECT "{column}"::text FROM "{table}"'))).scalars().all()
            for secret in secrets:
                assert not any(v is not None and secret[3:] in v for v in values), (table, column)
                assert not any(v is not None and secret.encode().hex() in v for v in values), (table, column)


async def test_authenticate_refuses_revoked_and_suspended(db_engine):
    tenant = await create_tenant(db_engine, "acme", weight=2.0, quota=Quotas(max_output_tokens=64))
    key, secret = await create_key(db_engine, "acme")
    auth = KeyAuthenticator(db_engine, ttl_s=0.0)
    principal = await auth.authenticate(secret)
    assert (principal.tenant_id, principal.key_id, principal.tenant.weight) == (tenant.id, key.id, 2.0)
    assert principal.quotas.max_output_tokens == 64
    assert secret.startswith(principal.key_prefix)

    with pytest.raises(UnknownKey):
        await auth.authenticate(secret[:-1] + ("A" if secret[-1] != "A" else "B"))
    with pytest.raises(UnknownKey):
        await auth.authenticate("not-a-key")

    await set_tenant_status(db_engine, "acme", "suspended")
    with pytest.raises(TenantSuspended):
        await auth.authenticate(secret)
    await set_tenant_status(db_engine, "acme", "active")
    assert (await auth.authenticate(secret)).tenant_id == tenant.id

    await revoke_key(db_engine, key.id)
    with pytest.raises(RevokedKey):
        await auth.authenticate(secret)
    await auth.close()
    [listed] = await list_keys(db_engine, "acme")
    assert listed.revoked and listed.last_used_at is not None


async def test_cached_lookup_follows_revocation_after_ttl(db_engine):
    await create_tenant(db_engine, "acme")
    key, secret = await create_key(db_engine, "acme")
    now = [100.0]  # the cache's clock, in seconds that binary floats hold exactly
    auth = KeyAuthenticator(db_engine, ttl_s=4.0, clock=lambda: now[0])
    await auth.authenticate(secret)
    await revoke_key(db_engine, key.id)
    now[0] += 3.75
    await auth.authenticate(secret)  # still cached: revocation takes up to the TTL
    now[0] += 0.25
    with pytest.raises(RevokedKey):  # the TTL has passed: looked up again
        await auth.authenticate(secret)


async def test_admin_rejects_bad_input(db_engine):
    await create_tenant(db_engine, "acme")
    with pytest.raises(Conflict):
        await create_tenant(db_engine, "acme")
    with pytest.raises(InvalidValue):
        await create_tenant(db_engine, "bad name")
    with pytest.raises(InvalidValue):
        await create_tenant(db_engine, "x", quota=Quotas(cost_per_minute=-1))
    with pytest.raises(InvalidValue):
        await update_tenant(db_engine, "acme", max_concurrency=0)
    with pytest.raises(InvalidValue):
        await update_tenant(db_engine, "acme", colour="red")
    with pytest.raises(NotFound):
        await update_tenant(db_engine, "nobody", weight=2)
    with pytest.raises(NotFound):
        await create_key(db_engine, "nobody")
    with pytest.raises(NotFound):
        await revoke_key(db_engine, 12345)
    updated = await update_tenant(db_engine, "acme", weight=3, monthly_budget=100.0)
    assert (updated.weight, updated.quotas.monthly_budget) == (3, 100.0)
    cleared = await update_tenant(db_engine, "acme", monthly_budget=None)
    assert cleared.quotas.monthly_budget is None and cleared.weight == 3
