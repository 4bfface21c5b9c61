"""Synthetic usage: a ledger of plausible traffic for trying the dashboard (``weir demo --traffic``) and for
the dashboard benchmark (a million rows).

Requests arrive with a daily rhythm (busy from 08:00 to 20:00 UTC, quieter at weekends), are shared among
tenants by their ``share`` and are written in time order, as a live ledger is. Prompt and output lengths
are log-normal, part of each prompt comes from the prefix cache, and latencies grow with load, so that
busy hours miss targets more often. Refusals come with load too, for the reasons each tenant is exposed
to. Costs use the default weights (1 : 0.1 : 2, engine/cost.py). Rows go in with COPY, a batch at a
time; the rollups are refreshed at the end.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.admin import create_key, create_tenant
from tenants.records import Quotas
from tenants.rollups import HOUR, floor_to, refresh_rollups

_CACHED_WEIGHT = Decimal("0.1")
_BATCH = 50_000
USAGE_COLUMNS = (
    "request_id",
    "tenant_id",
    "key_id",
    "model",
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "cost",
    "status",
    "finish_reason",
    "queue_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "started_at",
    "finished_at",
)


@dataclass(frozen=True)
class TrafficTenant:
    """A tenant to create and the traffic it sends: ``share`` of all requests, typical prompt length,
    and the refusal reasons it meets when the server is busy."""

    name: str
    share: float
    prompt_tokens: int = 600
    output_tokens: int = 150
    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.2
    weight: float = 1.0
    quota: Quotas = Quotas()
    refusals: tuple[str, ...] = ("queue", "slo", "kv")
    keys: int = 2


DEMO_TENANTS = (
    TrafficTenant(
        "acme",
        0.45,
        prompt_tokens=900,
        weight=2.0,
        quota=Quotas(cost_per_minute=200_000, max_concurrency=32),
        refusals=("rate", "concurrency", "queue", "slo"),
        keys=3,
    ),
    TrafficTenant(
        "globex",
        0.3,
        prompt_tokens=2400,
        output_tokens=300,
        ttft_target_s=4.0,
        refusals=("kv", "queue", "slo"),
    ),
    TrafficTenant(
        "initech",
        0.15,
        prompt_tokens=250,
        output_tokens=60,
        ttft_target_s=0.8,
        tpot_target_s=0.08,
        quota=Quotas(monthly_budget=5_000_000),
        refusals=("budget", "slo", "deadline"),
    ),
    TrafficTenant(
        "umbrella", 0.1, prompt_tokens=400, quota=Quotas(max_concurrency=4), refusals=("concurrency",)
    ),
)


def bench_tenants(count: int) -> list[TrafficTenant]:
    """``count`` tenants whose shares fall off like a Zipf law (a few large, many small)."""
    return [
        TrafficTenant(f"tenant-{i:02d}", 1 / (i + 1), prompt_tokens=200 + 97 * (i % 20), keys=1 + i % 3)
        for i in range(count)
    ]


def load(moment: datetime) -> float:
    """Relative traffic at ``moment`` (0.15 at night to 1 at 14:00 UTC on a weekday)."""
    hour = moment.hour + moment.minute / 60
    day = max(0.0, math.sin(math.pi * (hour - 6) / 16)) if 6 <= hour <= 22 else 0.0
    weekend = 0.45 if moment.weekday() >= 5 else 1.0
    return (0.15 + 0.85 * day**1.5) * weekend


@dataclass
class _Made:
    tenant_id: int
    key_ids: list[int]
    spec: TrafficTenant


def _arrivals(
    rng: random.Random, since: datetime, until: datetime, requests: int
) -> Iterator[tuple[datetime, float]]:
    """``requests`` arrival times in time order, with the load at each: each hour (or part of one) gets
    its share of the requests by :func:`load` at its middle, spread at random within it."""
    spans, start = [], since
    while start < until:
        end = min(until, floor_to(start, HOUR) + HOUR)
        spans.append((start, end, load(start + (end - start) / 2) * (end - start).total_seconds()))
        start = end
    total = sum(weight for _, _, weight in spans)
    exact = [requests * weight / total for _, _, weight in spans]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(spans)), key=lambda i: counts[i] - exact[i])[: requests - sum(counts)]:
        counts[i] += 1  # the largest remainders
    for (start, end, _), count in zip(spans, counts, strict=True):
        seconds = (end - start).total_seconds()
        for offset in sorted(rng.random() * seconds for _ in range(count)):
            moment = start + timedelta(seconds=offset)
            yield moment, load(moment)


def _request(rng: random.Random, made: _Made, model: str, moment: datetime, busy: float, n: int) -> tuple:
    spec = made.spec
    prompt = max(1, int(rng.lognormvariate(math.log(spec.prompt_tokens), 0.8)))
    cached = int(prompt * rng.random() * 0.7) if rng.random() < 0.5 else 0
    roll = rng.random()
    status, finish = (
        ("ok", "stop") if roll < 0.9 else ("ok", "length") if roll < 0.96 else ("cancelled", None)
    )
    if roll > 0.993:
        status, finish = "error", None
    output = max(1, int(rng.lognormvariate(math.log(spec.output_tokens), 0.7))) if status == "ok" else 0
    if status == "cancelled":
        output = rng.randint(0, spec.output_tokens)
    pressure = 1 + 3 * busy**4
    queue = rng.expovariate(1 / (0.05 * pressure))
    ttft = queue + (0.04 + (prompt - cached) / 9000) * pressure * rng.lognormvariate(0, 0.35)
    tpot = 0.035 * pressure * rng.lognormvariate(0, 0.3) if output > 1 else None
    e2e = ttft + (tpot or 0) * max(0, output - 1)
    cost = Decimal(prompt - cached) + _CACHED_WEIGHT * cached + 2 * output
    key = made.key_ids[n % len(made.key_ids)] if made.key_ids else None
    started = moment - timedelta(seconds=e2e)
    return (
        f"syn-{n:09d}-{uuid.UUID(int=rng.getrandbits(128)).hex[:12]}",
        made.tenant_id,
        key,
        model,
        prompt,
        cached,
        output,
        cost,
        status,
        finish,
        queue,
        ttft,
        tpot,
        e2e,
        started,
        moment,
    )


async def fill(
    db: AsyncEngine,
    tenants: list[TrafficTenant] | tuple[TrafficTenant, ...],
    since: datetime,
    until: datetime,
    requests: int,
    *,
    refusal_share: float = 0.03,
    models: tuple[str, ...] = ("SmolLM2-135M-Instruct",),
    seed: int = 0,
) -> tuple[int, int]:
    """Create ``tenants`` with their keys and write ``requests`` usage rows in ``[since, until)`` and about
    ``refusal_share`` as many refusals (more of them at busy hours); returns the rows written of each."""
    rng = random.Random(seed)
    made = []
    for spec in tenants:
        tenant = await create_tenant(
            db,
            spec.name,
            weight=spec.weight,
            ttft_target_s=spec.ttft_target_s,
            tpot_target_s=spec.tpot_target_s,
            quota=spec.quota,
        )
        keys = [(await create_key(db, tenant.id))[0].id for _ in range(spec.keys)]
        made.append(_Made(tenant.id, keys, spec))
    shares = [spec.share for spec in tenants]
    arrivals = _arrivals(rng, since, until, requests)
    written = refused = 0
    while written < requests:
        usage, shed = [], []
        for n in range(written, min(requests, written + _BATCH)):
            moment, busy = next(arrivals)
            who = rng.choices(made, shares)[0]
            usage.append(_request(rng, who, models[n % len(models)], moment, busy, n))
            if rng.random() < refusal_share * 4 * busy**3:
                reason = rng.choice(who.spec.refusals)
                shed.append((uuid.UUID(int=rng.getrandbits(128)).hex, who.tenant_id, reason, moment))
        async with db.begin() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            await raw.copy_records_to_table("usage_events", records=usage, columns=USAGE_COLUMNS)
            await raw.copy_records_to_table(
                "shed_events", records=shed, columns=("event_id", "tenant_id", "reason", "at")
            )
        written += len(usage)
        refused += len(shed)
    await refresh_rollups(db)
    async with db.connect() as conn:  # a bulk load: give the planner the new tables' statistics now
        await conn.execute(
            sa.text("ANALYZE usage_events, shed_events, usage_rollups, shed_rollups, latency_rollups")
        )
        await conn.commit()
    return written, refused
