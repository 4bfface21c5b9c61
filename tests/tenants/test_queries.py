"""Dashboard and billing queries over a known ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tenants.admin import create_tenant
from tenants.queries import latency_percentiles, shed_counts, usage_by_day
from tenants.usage import ShedEvent, UsageEvent, write_events

DAY = datetime(2026, 3, 10, 12, tzinfo=UTC)


def _event(n: int, tenant_id: int, model: str, at: datetime, status: str = "ok") -> UsageEvent:
    return UsageEvent(
        request_id=f"req-{tenant_id}-{n}",
        tenant_id=tenant_id,
        key_id=None,
        model=model,
        prompt_tokens=10 * n,
        cached_tokens=n,
        output_tokens=n + 1,
        cost=float(n),
        status=status,
        finish_reason="stop" if status == "ok" else None,
        queue_s=0.0,
        ttft_s=n / 100,
        tpot_s=n / 1000,
        e2e_s=1.0,
        started_at=at - timedelta(seconds=1),
        finished_at=at,
    )


async def test_usage_latency_and_shed_queries(db_engine):
    a = await create_tenant(db_engine, "alpha")
    b = await create_tenant(db_engine, "beta")
    events = [_event(n, a.id, "smol", DAY) for n in range(1, 101)]
    events += [_event(1, b.id, "smol", DAY + timedelta(days=1), status="error")]
    events += [_event(2, b.id, "other", DAY + timedelta(days=1))]
    events += [_event(3, b.id, "smol", DAY - timedelta(days=40))]  # outside the window
    events += [ShedEvent(a.id, "rate", DAY), ShedEvent(a.id, "rate", DAY), ShedEvent(b.id, "kv", DAY)]
    await write_events(db_engine, events)
    await write_events(db_engine, events[:10])  # idempotent

    since = DAY - timedelta(days=1)
    usage = await usage_by_day(db_engine, since)
    assert [(u.tenant_name, u.day.isoformat(), u.model, u.requests, u.errors) for u in usage] == [
        ("alpha", "2026-03-10", "smol", 100, 0),
        ("beta", "2026-03-11", "other", 1, 0),
        ("beta", "2026-03-11", "smol", 1, 1),
    ]
    assert usage[0].cost == sum(range(1, 101)) and usage[0].prompt_tokens == 10 * sum(range(1, 101))
    only_b = await usage_by_day(db_engine, since, tenant_id=b.id)
    assert {u.tenant_id for u in only_b} == {b.id}

    [alpha, beta] = await latency_percentiles(db_engine, since)
    assert alpha.requests == 100
    assert abs(alpha.ttft_p50 - 0.505) < 1e-9 and abs(alpha.ttft_p99 - 0.9901) < 1e-9
    assert beta.requests == 2 and alpha.tpot_p90 > alpha.tpot_p50

    shed = await shed_counts(db_engine, since, DAY + timedelta(hours=1))
    assert [(s.tenant_name, s.reason, s.count) for s in shed] == [("alpha", "rate", 2), ("beta", "kv", 1)]
