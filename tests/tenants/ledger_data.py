"""A random ledger for the reporting and export tests: tenants with keys, usage and refusal events."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from tenants.admin import create_key, create_tenant
from tenants.models import SHED_REASONS
from tenants.usage import ShedEvent, UsageEvent

START = datetime(2026, 5, 30, 0, tzinfo=UTC)
SPAN = timedelta(days=4)


def moment(rng: random.Random) -> datetime:
    """A random time in the span; one in five exactly on an hour."""
    moment = START + timedelta(seconds=rng.uniform(0, SPAN.total_seconds()))
    return moment.replace(minute=0, second=0, microsecond=0) if rng.random() < 0.2 else moment


def usage_events(rng: random.Random, tenants: list[tuple[int, list[int]]], n: int) -> list[UsageEvent]:
    events = []
    for i in range(n):
        tenant_id, keys = rng.choice(tenants)
        prompt, output = rng.randint(0, 4000), rng.randint(0, 500)
        cached = rng.randint(0, prompt)
        finished = moment(rng)
        events.append(
            UsageEvent(
                request_id=f"req-{rng.getrandbits(64):x}-{i}",
                tenant_id=tenant_id,
                key_id=rng.choice([*keys, None]),
                model=rng.choice(["smol", "big"]),
                prompt_tokens=prompt,
                cached_tokens=cached,
                output_tokens=output,
                cost=0.97 * (prompt - cached) + 0.113 * cached + 2.31 * output,  # not exact in binary
                status=rng.choice(["ok", "ok", "ok", "error", "cancelled"]),
                finish_reason=rng.choice(["stop", "length", None]),
                queue_s=rng.uniform(0, 1),
                ttft_s=rng.choice([None, rng.lognormvariate(-1, 1), rng.uniform(0, 0.001)]),
                tpot_s=rng.choice([None, rng.lognormvariate(-3, 0.7)]),
                e2e_s=rng.uniform(0, 30),
                started_at=finished - timedelta(seconds=5),
                finished_at=finished,
            )
        )
    return events


TARGETS = (("acme", 0.5, 0.05), ("globex", 1.0, 0.1), ("initech", 0.2, 0.03))


async def ledger_tenants(db_engine) -> tuple[dict[int, tuple[float, float]], list[tuple[int, list[int]]]]:
    """Three tenants with two keys each: their (TTFT, TPOT) targets by id, and (id, key ids) pairs."""
    targets, tenants = {}, []
    for name, ttft, tpot in TARGETS:
        tenant = await create_tenant(db_engine, name, ttft_target_s=ttft, tpot_target_s=tpot)
        keys = [(await create_key(db_engine, tenant.id))[0].id for _ in range(2)]
        targets[tenant.id] = (ttft, tpot)
        tenants.append((tenant.id, keys))
    return targets, tenants


def shed_events(rng: random.Random, tenants: list[tuple[int, list[int]]], n: int) -> list[ShedEvent]:
    return [ShedEvent(rng.choice(tenants)[0], rng.choice(SHED_REASONS), moment(rng)) for _ in range(n)]
