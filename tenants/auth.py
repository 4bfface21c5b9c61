"""Key authentication with a short in-process cache.

A lookup result (found or refused) is cached for ``ttl_s`` seconds, so revoking a key or suspending a
tenant takes effect everywhere within that TTL. ``last_used_at`` is written in batches (at most once per
``last_used_interval_s`` per process), never once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.admin import TENANT_COLUMNS, tenant_from_row
from tenants.background import detached
from tenants.keys import digest_matches, hash_secret, secret_prefix, well_formed
from tenants.models import api_keys, quotas, tenants
from tenants.records import Quotas, Tenant


class AuthError(Exception):
    """A refused key; ``reason`` is one of ``unknown_key``, ``revoked_key``, ``tenant_suspended``."""

    reason = "unknown_key"


class UnknownKey(AuthError):
    reason = "unknown_key"


class RevokedKey(AuthError):
    reason = "revoked_key"


class TenantSuspended(AuthError):
    reason = "tenant_suspended"


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key and its tenant (with weight, latency targets and quotas)."""

    key_id: int
    key_prefix: str
    tenant: Tenant

    @property
    def tenant_id(self) -> int:
        return self.tenant.id

    @property
    def tenant_name(self) -> str:
        return self.tenant.name

    @property
    def quotas(self) -> Quotas:
        return self.tenant.quotas


class KeyAuthenticator:
    """``await auth.authenticate(secret) -> Principal`` or raises an :class:`AuthError` subclass."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        ttl_s: float = 5.0,
        last_used_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        self._last_used_interval_s = last_used_interval_s
        self._clock = clock  # seconds, for the cache's TTL and the flush interval
        self._cache: dict[bytes, tuple[float, Principal | AuthError]] = {}
        self._used: dict[int, datetime] = {}
        self._last_flush = clock()
        self._flush_task: asyncio.Task[None] | None = None

    async def authenticate(self, secret: str) -> Principal:
        if not well_formed(secret):
            raise UnknownKey("invalid API key")
        digest = hash_secret(secret)
        now = self._clock()
        cached = self._cache.get(digest)
        if cached is None or cached[0] <= now:
            cached = (now + self._ttl_s, await self._lookup(secret, digest))
            self._cache[digest] = cached
            if len(self._cache) > 100_000:
                self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        result = cached[1]
        if isinstance(result, AuthError):
            raise type(result)(str(result))
        self._note_use(result.key_id, now)
        return result

    async def _lookup(self, secret: str, digest: bytes) -> Principal | AuthError:
        query = (
            sa.select(
                api_keys.c.id.label("key_id"), api_keys.c.key_hash, api_keys.c.revoked_at, *TENANT_COLUMNS
            )
            .select_from(api_keys.join(tenants).outerjoin(quotas))
            .where(api_keys.c.key_hash == digest)
        )
        async with self._engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None or not digest_matches(row.key_hash, secret):
            return UnknownKey("invalid API key")
        if row.revoked_at is not None:
            return RevokedKey("this API key has been revoked")
        tenant = tenant_from_row(row)
        if not tenant.active:
            return TenantSuspended(f"tenant {tenant.name!r} is suspended")
        return Principal(key_id=row.key_id, key_prefix=secret_prefix(secret), tenant=tenant)

    def _note_use(self, key_id: int, now: float) -> None:
        self._used[key_id] = datetime.now(UTC)
        if now - self._last_flush >= self._last_used_interval_s and self._flush_task is None:
            self._last_flush = now
            self._flush_task = detached(self._flush_quietly(), name="weir-key-last-use")

    async def _flush_quietly(self) -> None:
        try:
            with contextlib.suppress(Exception):  # last_used is advisory; the next flush retries
                await self.flush_last_used()
        finally:
            self._flush_task = None

    async def flush_last_used(self) -> None:
        """Write the pending ``last_used_at`` times in one statement."""
        used, self._used = self._used, {}
        if not used:
            return
        try:
            async with self._engine.begin() as conn:
                await conn.execute(
                    sa.update(api_keys)
                    .where(api_keys.c.id == sa.bindparam("kid"))
                    .values(last_used_at=sa.func.greatest(api_keys.c.last_used_at, sa.bindparam("at"))),
                    [{"kid": k, "at": at} for k, at in sorted(used.items())],
                )
        except BaseException:
            for key_id, at in used.items():
                self._used.setdefault(key_id, at)
            raise

    async def close(self) -> None:
        """Write what is pending; call on shutdown."""
        if self._flush_task is not None:
            await self._flush_task
        await self.flush_last_used()
