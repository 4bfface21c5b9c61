"""``TenantStore``: this process's handle on the tenant store (key auth, quotas, the usage writer), with
every answer the store gives turned into the API's: a refusal into its error, an outage into a 503."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import sqlalchemy as sa
from litestar.exceptions import HTTPException
from sqlalchemy.ext.asyncio import AsyncEngine as Database

from api import tracing
from api.auth import authenticate
from api.errors import APIError
from api.openai_format import rate_limit_headers
from api.refusals import database_unavailable_is_503, quota_refusal
from tenants.auth import KeyAuthenticator, Principal
from tenants.quotas import QuotaManager, Reservation
from tenants.usage import UsageEvent, UsageWriter

log = logging.getLogger("weir.api")

RATE_LIMIT_READ_TIMEOUT_S = 2.0  # the one read of a tenant's quota row before its first headers


class TenantStore:
    """Key auth, quotas and the usage ledger of one API process, opened in the app's lifespan."""

    def __init__(self, database_url: str | None, spill_dir: Path) -> None:
        self._database_url = database_url
        self._spill_dir = spill_dir
        self.db: Database | None = None  # the SQLAlchemy engine, made in open()
        self._authenticator: KeyAuthenticator | None = None
        self._quotas: QuotaManager | None = None
        self._usage: UsageWriter | None = None

    async def open(self) -> None:
        from tenants.db import create_engine

        self.db = create_engine(self._database_url)
        self._authenticator = KeyAuthenticator(self.db)
        self._quotas = QuotaManager(self.db)
        self._usage = UsageWriter(self.db, spill_dir=self._spill_dir)
        self._usage.start()

    def engines(self) -> list[Database]:
        """Every SQLAlchemy engine the store runs statements on: the main one and the quotas' own."""
        assert self.db is not None and self._quotas is not None, "TenantStore.open() first"
        return [self.db, self._quotas.engine]

    async def close(self) -> None:
        """Write what is pending (usage events, leases, last-used times), then close the database."""
        for name, part in (
            ("usage", self._usage),
            ("quotas", self._quotas),
            ("authenticator", self._authenticator),
        ):
            if part is not None:
                try:
                    await part.close()
                except Exception:
                    log.exception("closing the %s failed", name)
        if self.db is not None:
            await self.db.dispose()

    async def reachable(self, timeout_s: float = 2.0) -> bool:
        """Whether the database answers a trivial query within ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s), self.db.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        except Exception:
            return False
        return True

    async def authenticate(self, header: str | None) -> Principal:
        with database_unavailable_is_503():
            return await authenticate(self._authenticator, header)

    async def reserve(self, principal: Principal, cost: float) -> Reservation:
        """Reserve ``cost`` for the tenant, or raise the 429 that says which limit refused (recorded)."""
        with database_unavailable_is_503(), tracing.reservation():
            outcome = await self._quotas.reserve(principal.tenant_id, cost)
        if isinstance(outcome, Reservation):
            return outcome
        self.record_shed(principal.tenant_id, outcome.reason)
        raise quota_refusal(outcome, cost)

    async def extend(self, reservation: Reservation, cost: float) -> bool:
        """Grow ``reservation`` by ``cost``; ``False`` when a limit refuses or the database cannot say."""
        try:
            return await self._quotas.extend(reservation, cost) is None
        except Exception as exc:
            log.warning("could not extend a reservation of tenant %s: %s", reservation.tenant_id, exc)
            return False

    def release(self, reservation: Reservation) -> None:
        self._quotas.release(reservation)

    def settle(self, reservation: Reservation, cost: float) -> None:
        self._quotas.settle(reservation, cost)

    def record_shed(self, tenant_id: int, reason: str) -> None:
        self._usage.record_shed(tenant_id, reason)
        tracing.refused(reason)

    def record_usage(self, event: UsageEvent) -> None:
        self._usage.submit(event)

    def ledger_backlog(self) -> int:
        """Usage events accepted but not yet in the database or a spill file."""
        return self._usage.pending

    async def rate_limit_headers(self, principal: Principal) -> dict[str, str]:
        """The tenant's ``x-ratelimit-*`` headers as its allowance stands now; none when the database,
        asked once for a tenant this process has not seen, does not answer within the timeout."""
        try:
            async with asyncio.timeout(RATE_LIMIT_READ_TIMEOUT_S):
                allowance = await self._quotas.allowance(principal.tenant_id)
        except Exception as exc:
            log.warning("no rate-limit headers for tenant %s: %s", principal.tenant_id, exc)
            return {}
        return rate_limit_headers(allowance) if allowance is not None else {}

    @contextlib.asynccontextmanager
    async def rate_limit_headers_on_refusal(self, principal: Principal) -> AsyncIterator[None]:
        """Add the tenant's ``x-ratelimit-*`` headers to a refusal raised inside (its own headers win)."""
        try:
            yield
        except (APIError, HTTPException) as refusal:
            refusal.headers = {**await self.rate_limit_headers(principal), **(refusal.headers or {})}
            raise
