"""The serving process's live parts: the engine, the tenant store, and every request's cleanup.

``Runtime`` is what the routes talk to. It starts the engine and the database in the app's lifespan, and
it settles each request exactly once, in a task of its own (shielded), so that neither a client that
vanishes nor the framework cancelling the request's task can lose a usage record or a reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from litestar.exceptions import HTTPException

from api import tracing
from api.auth import authenticate
from api.errors import APIError
from api.metering import Job, Tracker
from api.openai_format import number_text, rate_limit_headers
from api.settings import Settings
from engine.cost import DEFAULT_WEIGHTS, CostWeights
from engine.types import RequestOutput
from tenants.auth import Principal
from tenants.quotas import Refusal, Reservation
from tenants.usage import UsageEvent

log = logging.getLogger("weir.api")

RATE_LIMIT_READ_TIMEOUT_S = 2.0  # the one read of a tenant's quota row before its first headers


class Runtime:
    """Engine + tenant store + bookkeeping for one API process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: Any = None  # engine.AsyncEngine, started in start()
        self.db: Any = None  # SQLAlchemy AsyncEngine
        self.weights: CostWeights = DEFAULT_WEIGHTS
        self.model_name = settings.model_name or ""
        self.ready = False
        self._cleanups: set[asyncio.Task] = set()
        self._counts: Counter[str] = Counter()
        self._active_by_tenant: Counter[int] = Counter()

    # --- lifecycle -------------------------------------------------------------------------------------

    async def start(self) -> None:
        from engine import AsyncEngine, EngineConfig
        from tenants.db import create_engine

        self.db = create_engine(self.settings.database_url)
        config = EngineConfig(
            model=self.settings.model, state_dir=self.settings.state_dir, **self.settings.engine_options
        )
        self.engine = AsyncEngine(config)
        await self.engine.start()
        self.model_name = self.settings.model_name or self.engine.model_name
        await self._start_tenants()
        self.ready = True
        log.info("serving model %s", self.model_name)

    async def stop(self) -> None:
        self.ready = False
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._stop_tenants()
        if self.engine is not None:
            await self.engine.stop()
        if self.db is not None:
            await self.db.dispose()

    async def database_reachable(self, timeout_s: float = 2.0) -> bool:
        """Whether the database answers a trivial query within ``timeout_s``."""
        import sqlalchemy as sa

        try:
            async with asyncio.timeout(timeout_s), self.db.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        except Exception:
            return False
        return True

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(
                503,
                "The server is starting; retry shortly.",
                type="server_error",
                code="not_ready",
                headers={"retry-after": "1"},
            )

    # --- model ---------------------------------------------------------------------------------------------

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the name this server serves."""
        if model != self.model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist. This server serves '{self.model_name}'.",
                param="model",
                code="model_not_found",
            )

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.core.vocab_size

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "weir"}

    def generate(self, job: Job) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(
            job.request_id,
            job.prompt_ids,
            job.params,
            tenant_id=str(job.tenant_id),
            priority=0,
            tpot_target_s=job.tpot_target_s,
            weight=job.weight,
        )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # --- requests' ends ----------------------------------------------------------------------------------

    def begin(self, job: Job) -> None:
        self._active_by_tenant[job.tenant_id] += 1

    async def finish(self, job: Job, tracker: Tracker) -> None:
        """Settle and meter ``job`` exactly once; runs to the end even if the caller is cancelled."""
        settlement = tracing.settled(self._finish(job, tracker), tracker, tracker.cost(self.weights))
        task = asyncio.create_task(settlement, name=f"settle-{job.request_id}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def _finish(self, job: Job, tracker: Tracker) -> None:
        self._active_by_tenant[job.tenant_id] -= 1
        status, finish_reason = tracker.outcome()
        self._counts[f"requests_{status}"] += 1
        if tracker.dropped:
            self._counts["clients_dropped_slow"] += 1
        elif tracker.disconnected:
            self._counts["clients_disconnected"] += 1
        if not tracker.finished:
            self.abort(job.request_id)
        cost = tracker.cost(self.weights)
        try:
            await self.settle(job.reservation, cost)
        except Exception:
            log.exception("could not settle the reservation of %s", job.request_id)
        event = {
            "request_id": job.request_id,
            "tenant_id": job.tenant_id,
            "key_id": job.key_id,
            "model": self.model_name,
            "prompt_tokens": tracker.prompt_tokens,
            "cached_tokens": tracker.cached_tokens,
            "output_tokens": tracker.output_tokens,
            "cost": cost,
            "status": status,
            "finish_reason": finish_reason,
            **tracker.timings(),
            "started_at": job.started_at,
            "finished_at": datetime.now(UTC),
        }
        try:
            self.usage.submit(UsageEvent(**event))
        except Exception:  # a bug, never an outage (the writer spills): keep the record in the log
            log.exception("could not record usage event %s", event)

    def counters(self) -> dict[str, int]:
        return {"requests_in_cleanup": len(self._cleanups), **self._counts}

    # --- tenant store ----------------------------------------------------------------------------------

    async def _start_tenants(self) -> None:
        from tenants.auth import KeyAuthenticator
        from tenants.quotas import QuotaManager
        from tenants.usage import UsageWriter

        self.authenticator = KeyAuthenticator(self.db)
        self.quotas = QuotaManager(self.db)
        self.usage = UsageWriter(self.db, spill_dir=Path(self.settings.state_dir) / "spill")
        self.usage.start()

    async def _stop_tenants(self) -> None:
        for part in ("usage", "quotas", "authenticator"):
            closer = getattr(self, part, None)
            if closer is not None:
                try:
                    await closer.close()
                except Exception:
                    log.exception("closing the %s failed", part)

    async def authenticate(self, header: str | None) -> Principal:
        with _database_unavailable_is_503():
            return await authenticate(self.authenticator, header)

    async def reserve(self, principal: Principal, cost: float) -> Reservation:
        """Reserve ``cost`` for the tenant, or raise the 429 that says which limit refused."""
        with _database_unavailable_is_503(), tracing.reservation():
            outcome = await self.quotas.reserve(principal.tenant_id, cost)
        if isinstance(outcome, Reservation):
            return outcome
        await self.record_shed(principal, outcome.reason)
        raise quota_refusal(outcome, cost)

    async def extend(self, reservation: Reservation, cost: float) -> bool:
        """Grow ``reservation`` by ``cost``; ``False`` when a limit refuses or the database cannot say."""
        try:
            return await self.quotas.extend(reservation, cost) is None
        except Exception as exc:
            log.warning("could not extend a reservation of tenant %s: %s", reservation.tenant_id, exc)
            return False

    async def rate_limit_headers(self, principal: Principal) -> dict[str, str]:
        """The tenant's ``x-ratelimit-*`` headers as its allowance stands now; none when the database,
        asked once for a tenant this process has not seen, does not answer within the timeout."""
        try:
            async with asyncio.timeout(RATE_LIMIT_READ_TIMEOUT_S):
                allowance = await self.quotas.allowance(principal.tenant_id)
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

    async def release(self, reservation: Reservation) -> None:
        self.quotas.release(reservation)

    async def settle(self, reservation: Reservation, cost: float) -> None:
        self.quotas.settle(reservation, cost)

    async def record_shed(self, principal: Principal, reason: str) -> None:
        self.usage.record_shed(principal.tenant_id, reason)
        tracing.refused(reason)

    async def tenants_overview(self) -> list[dict]:
        """Every tenant with its quotas and this month's usage and refusals."""
        from tenants.admin import list_tenants
        from tenants.queries import shed_counts, usage_by_day

        month_start = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        tenants, usage, shed = await asyncio.gather(
            list_tenants(self.db), usage_by_day(self.db, month_start), shed_counts(self.db, month_start)
        )
        totals: dict[int, Counter] = {}
        for row in usage:
            totals.setdefault(row.tenant_id, Counter()).update(
                {
                    name: getattr(row, name)
                    for name in (
                        "requests",
                        "errors",
                        "prompt_tokens",
                        "cached_tokens",
                        "output_tokens",
                        "cost",
                    )
                }
            )
        refusals: dict[int, dict[str, int]] = {}
        for row in shed:
            refusals.setdefault(row.tenant_id, {})[row.reason] = row.count
        return [
            {
                "id": t.id,
                "name": t.name,
                "status": t.status,
                "weight": t.weight,
                "ttft_target_s": t.ttft_target_s,
                "tpot_target_s": t.tpot_target_s,
                "quotas": dataclasses.asdict(t.quotas),
                "month": dict(totals.get(t.id, Counter())),
                "refused": refusals.get(t.id, {}),
                "active_requests": self._active_by_tenant.get(t.id, 0),
            }
            for t in tenants
        ]


@contextlib.contextmanager
def _database_unavailable_is_503() -> Iterator[None]:
    """A database that cannot be reached refuses the request with a retryable 503, not a 500."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    try:
        yield
    except (DBAPIError, InterfaceError, OperationalError, OSError, TimeoutError) as exc:
        log.warning("database unavailable: %s", exc)
        raise APIError(
            503,
            "The server cannot reach its database right now; please retry shortly.",
            type="server_error",
            code="service_unavailable",
            headers={"retry-after": "2"},
        ) from None


def quota_refusal(refusal: Refusal, cost: float) -> APIError:
    """The 429 for a refused reservation; its ``x-ratelimit-*`` headers are added with every refusal's
    (``Runtime.rate_limit_headers_on_refusal``)."""
    if refusal.reason == "budget":
        return APIError(
            429,
            "You exceeded your current quota: the monthly cost budget is spent.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers={"x-should-retry": "false"},
        )
    remaining = max(0.0, refusal.remaining)
    headers = {}
    if not refusal.retryable:
        headers["x-should-retry"] = "false"
        message = (
            f"This request's worst-case cost ({cost:.0f}) exceeds the per-minute limit "
            f"({number_text(refusal.limit)}); lower max_tokens or shorten the prompt."
        )
    else:
        headers["retry-after"] = str(max(1, math.ceil(refusal.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(refusal.retry_after_s * 1000)))
        what = "cost per minute" if refusal.reason == "rate" else "concurrent requests"
        message = (
            f"Rate limit reached for {what}: limit {number_text(refusal.limit)}, remaining "
            f"{number_text(remaining)}. Please try again in {refusal.retry_after_s:.2f}s."
        )
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)
