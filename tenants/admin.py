"""Tenant and key administration (what ``weir tenant`` and ``weir key`` do)."""

from __future__ import annotations

import re
from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tenants.keys import hash_secret, new_secret, secret_prefix
from tenants.models import TENANT_STATUSES, api_keys, quota_state, quotas, tenants
from tenants.records import (
    ApiKey,
    Conflict,
    InvalidValue,
    NotFound,
    Quotas,
    Tenant,
    check_positive,
    from_row,
)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_TENANT_FIELDS = {"weight": "weight", "ttft_target_s": "TTFT target (s)", "tpot_target_s": "TPOT target (s)"}
_QUOTA_FIELDS = tuple(f.name for f in fields(Quotas))

TENANT_COLUMNS = (
    tenants.c.id,
    tenants.c.name,
    tenants.c.weight,
    tenants.c.status,
    tenants.c.ttft_target_s,
    tenants.c.tpot_target_s,
    tenants.c.created_at,
    quotas.c.cost_per_minute,
    quotas.c.max_concurrency,
    quotas.c.monthly_budget,
    quotas.c.max_output_tokens,
)


def tenant_from_row(row: Any) -> Tenant:
    return from_row(Tenant, row, quotas=from_row(Quotas, row))


def _check_tenant_values(values: dict[str, Any]) -> None:
    for name, label in _TENANT_FIELDS.items():
        if name in values:
            if values[name] is None:
                raise InvalidValue(f"{label} needs a number")
            check_positive(label, values[name])


def _select_tenants() -> sa.Select:
    return sa.select(*TENANT_COLUMNS).select_from(tenants.outerjoin(quotas))


def _tenant_filter(ref: str | int) -> sa.ColumnElement[bool]:
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isascii() and ref.isdigit() and len(ref) < 19):
        return sa.or_(tenants.c.id == int(ref), tenants.c.name == str(ref))
    return tenants.c.name == ref


async def _tenant_id(conn: AsyncConnection, ref: str | int) -> int:
    tenant_id = (await conn.execute(sa.select(tenants.c.id).where(_tenant_filter(ref)))).scalar()
    if tenant_id is None:
        raise NotFound(f"no tenant {ref!r}")
    return int(tenant_id)


async def create_tenant(
    engine: AsyncEngine,
    name: str,
    *,
    weight: float = 1.0,
    ttft_target_s: float = 2.0,
    tpot_target_s: float = 0.2,
    quota: Quotas | None = None,
) -> Tenant:
    """Create an active tenant with its quotas; :class:`Conflict` if the name exists."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name.isdigit():
        raise InvalidValue(
            f"invalid tenant name {name!r}: use 1-64 letters, digits, '.', '_' or '-' (not only digits)"
        )
    _check_tenant_values({"weight": weight, "ttft_target_s": ttft_target_s, "tpot_target_s": tpot_target_s})
    quota = quota or Quotas()
    try:
        async with engine.begin() as conn:
            tenant_id = (
                await conn.execute(
                    sa.insert(tenants)
                    .values(
                        name=name, weight=weight, ttft_target_s=ttft_target_s, tpot_target_s=tpot_target_s
                    )
                    .returning(tenants.c.id)
                )
            ).scalar_one()
            await conn.execute(sa.insert(quotas).values(tenant_id=tenant_id, **_quota_values(quota)))
            await conn.execute(
                sa.insert(quota_state).values(
                    tenant_id=tenant_id,
                    bucket_level=quota.cost_per_minute or 0,
                    period_start=sa.func.date_trunc("month", sa.func.timezone("UTC", sa.func.now())),
                )
            )
    except IntegrityError as exc:
        raise Conflict(f"a tenant named {name!r} already exists") from exc
    return await get_tenant(engine, tenant_id)


def _quota_values(quota: Quotas) -> dict[str, Any]:
    return {name: getattr(quota, name) for name in _QUOTA_FIELDS}


async def get_tenant(engine: AsyncEngine, ref: str | int) -> Tenant:
    """The tenant with that name or id; :class:`NotFound` otherwise."""
    async with engine.connect() as conn:
        row = (await conn.execute(_select_tenants().where(_tenant_filter(ref)))).first()
    if row is None:
        raise NotFound(f"no tenant {ref!r}")
    return tenant_from_row(row)


async def list_tenants(engine: AsyncEngine) -> list[Tenant]:
    async with engine.connect() as conn:
        rows = (await conn.execute(_select_tenants().order_by(tenants.c.name))).all()
    return [tenant_from_row(row) for row in rows]


async def update_tenant(engine: AsyncEngine, ref: str | int, **changes: Any) -> Tenant:
    """Change ``weight``, ``ttft_target_s``, ``tpot_target_s`` or quota fields (``None`` = unlimited)."""
    unknown = set(changes) - set(_TENANT_FIELDS) - set(_QUOTA_FIELDS)
    if unknown:
        raise InvalidValue(f"cannot update {', '.join(sorted(unknown))}")
    _check_tenant_values(changes)
    quota_changes = {k: v for k, v in changes.items() if k in _QUOTA_FIELDS}
    async with engine.begin() as conn:
        tenant_id = await _tenant_id(conn, ref)
        current = (await conn.execute(sa.select(quotas).where(quotas.c.tenant_id == tenant_id))).first()
        merged = from_row(Quotas, current) if current is not None else Quotas()
        Quotas(**{**_quota_values(merged), **quota_changes})  # validates
        tenant_changes = {k: v for k, v in changes.items() if k in _TENANT_FIELDS}
        await conn.execute(
            sa.update(tenants)
            .where(tenants.c.id == tenant_id)
            .values(updated_at=sa.func.now(), **tenant_changes)
        )
        if quota_changes:
            await conn.execute(
                sa.update(quotas).where(quotas.c.tenant_id == tenant_id).values(**quota_changes)
            )
    return await get_tenant(engine, tenant_id)


async def set_tenant_status(engine: AsyncEngine, ref: str | int, status: str) -> Tenant:
    """Suspend (``"suspended"``) or resume (``"active"``) a tenant; its keys follow within the auth TTL."""
    if status not in TENANT_STATUSES:
        raise InvalidValue(f"unknown status {status!r}")
    async with engine.begin() as conn:
        tenant_id = await _tenant_id(conn, ref)
        await conn.execute(
            sa.update(tenants)
            .where(tenants.c.id == tenant_id)
            .values(status=status, updated_at=sa.func.now())
        )
    return await get_tenant(engine, tenant_id)


async def create_key(engine: AsyncEngine, tenant_ref: str | int) -> tuple[ApiKey, str]:
    """A new key for the tenant: its record and the secret, which is shown this once and never stored."""
    secret = new_secret()
    async with engine.begin() as conn:
        tenant_id = await _tenant_id(conn, tenant_ref)
        row = (
            await conn.execute(
                sa.insert(api_keys)
                .values(tenant_id=tenant_id, prefix=secret_prefix(secret), key_hash=hash_secret(secret))
                .returning(*api_keys.c)
            )
        ).one()
    return from_row(ApiKey, row), secret


async def list_keys(engine: AsyncEngine, tenant_ref: str | int) -> list[ApiKey]:
    async with engine.connect() as conn:
        tenant_id = await _tenant_id(conn, tenant_ref)
        rows = (
            await conn.execute(
                sa.select(api_keys).where(api_keys.c.tenant_id == tenant_id).order_by(api_keys.c.id)
            )
        ).all()
    return [from_row(ApiKey, row) for row in rows]


async def revoke_key(engine: AsyncEngine, key_id: int) -> ApiKey:
    """Revoke a key (idempotent: an already revoked key keeps its first revocation time)."""
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                sa.update(api_keys)
                .where(api_keys.c.id == key_id)
                .values(revoked_at=sa.func.coalesce(api_keys.c.revoked_at, datetime.now(UTC)))
                .returning(*api_keys.c)
            )
        ).first()
    if row is None:
        raise NotFound(f"no key with id {key_id}")
    return from_row(ApiKey, row)
