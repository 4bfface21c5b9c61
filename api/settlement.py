"""``Settlement``: a request's reservation and usage event, from admission to its end.

Each request is settled exactly once, in a task of its own awaited through ``asyncio.shield``, so that
neither a client that vanishes nor the framework cancelling the request's task can lose a usage record or
a reservation; shutdown waits for these tasks (``drain``) before the tenant store closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import UTC, datetime

from api import tracing
from api.metering import Job, Tracker
from api.tenant_store import TenantStore
from engine import AsyncEngine
from engine.cost import CostWeights, request_cost
from tenants.usage import UsageEvent

log = logging.getLogger("weir.api")


class Settlement:
    """Settles admitted requests against the tenant store and counts how they ended."""

    def __init__(self, store: TenantStore, engine: AsyncEngine, weights: CostWeights) -> None:
        self._store = store
        self._engine = engine
        self._weights = weights
        self._cleanups: set[asyncio.Task] = set()
        self._counts: Counter[str] = Counter()
        self.active_by_tenant: Counter[int] = Counter()  # requests between begin() and their settlement

    def begin(self, job: Job) -> None:
        self.active_by_tenant[job.tenant_id] += 1

    async def extend(self, job: Job, output_tokens: int) -> bool:
        """Grow the request's reservation by ``output_tokens``; ``False`` when the store refuses."""
        return await self._store.extend(job.reservation, request_cost(0, 0, output_tokens, self._weights))

    async def finish(self, job: Job, tracker: Tracker) -> None:
        """Settle and meter ``job`` exactly once; runs to the end even if the caller is cancelled."""
        settlement = tracing.settled(self._finish(job, tracker), tracker, self._weights)
        task = asyncio.create_task(settlement, name=f"settle-{job.request_id}")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)

    async def drain(self) -> None:
        """Wait for every settlement in flight."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)

    def counters(self) -> dict[str, int]:
        return {"requests_in_cleanup": len(self._cleanups), **self._counts}

    async def _finish(self, job: Job, tracker: Tracker) -> None:
        self.active_by_tenant[job.tenant_id] -= 1
        if tracker.refused:  # refused unstarted, like a request shed at admission: no charge, no usage row
            self._counts["requests_refused_deadline"] += 1
            self._store.release(job.reservation)
            self._store.record_shed(job.tenant_id, "deadline")
            return
        status, finish_reason = tracker.outcome()
        self._counts[f"requests_{status}"] += 1
        if tracker.dropped:
            self._counts["clients_dropped_slow"] += 1
        elif tracker.disconnected:
            self._counts["clients_disconnected"] += 1
        if not tracker.finished:
            self._engine.abort(job.request_id)
        cost = job.reservation.cost  # charged if the counts cannot be costed (a bug, raised after)
        try:
            cost = tracker.cost(self._weights)
        finally:  # whatever happened, the reservation and its slot go back and the usage is recorded
            self._settle(job, cost)
            self._record(job, tracker, cost, status, finish_reason)

    def _settle(self, job: Job, cost: float) -> None:
        try:
            self._store.settle(job.reservation, cost)
        except Exception:
            log.exception("could not settle the reservation of %s", job.request_id)

    def _record(
        self, job: Job, tracker: Tracker, cost: float, status: str, finish_reason: str | None
    ) -> None:
        event = {
            "request_id": job.request_id,
            "tenant_id": job.tenant_id,
            "key_id": job.key_id,
            "model": job.shape.model,
            "prompt_tokens": tracker.prompt_tokens,
            "cached_tokens": tracker.total.cached_tokens,
            "output_tokens": tracker.total.output_tokens,
            "cost": cost,
            "status": status,
            "finish_reason": finish_reason,
            **tracker.timings(),
            "started_at": job.started_at,
            "finished_at": datetime.now(UTC),
        }
        try:
            self._store.record_usage(UsageEvent(**event))
        except Exception:  # a bug, never an outage (the writer spills): keep the record in the log
            log.exception("could not record usage event %s", event)
