"""The dashboard's figures over a known ledger."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from tenants.admin import create_key, create_tenant
from tenants.records import InvalidValue
from tenants.reporting import (
    MAX_SERIES_POINTS,
    LedgerFilter,
    Window,
    ledger_entry,
    ledger_page,
    overview,
    series_length,
    tenant_series,
    tenant_table,
)
from tenants.usage import ShedEvent, UsageEvent, write_events

T0 = datetime(2026, 3, 10, 12, tzinfo=UTC)


def _event(n: int, tenant_id: int, key_id: int | None, at: datetime, **changes) -> UsageEvent:
    values = dict(
        request_id=f"req-{tenant_id}-{n}",
        tenant_id=tenant_id,
        key_id=key_id,
        model="smol",
        prompt_tokens=10 * n,
        cached_tokens=n,
        output_tokens=n + 1,
        cost=n + 0.1,
        status="ok",
        finish_reason="stop",
        queue_s=0.0,
        ttft_s=n / 10,
        tpot_s=0.05,
        e2e_s=1.0,
        started_at=at - timedelta(seconds=1),
        finished_at=at,
    )
    return UsageEvent(**(values | changes))


async def test_overview_table_series_and_ledger(db_engine):
    a = await create_tenant(db_engine, "alpha", ttft_target_s=1.0)
    b = await create_tenant(db_engine, "beta")
    key, _ = await create_key(db_engine, a.id)
    events = [_event(n, a.id, key.id, T0 + timedelta(minutes=n)) for n in range(1, 21)]
    events += [_event(1, b.id, None, T0 + timedelta(hours=2), status="error", finish_reason=None)]
    events += [ShedEvent(a.id, "rate", T0), ShedEvent(a.id, "kv", T0), ShedEvent(b.id, "rate", T0)]
    await write_events(db_engine, events)
    window = Window(T0, T0 + timedelta(hours=3))

    total = await overview(db_engine, window)
    assert total.requests == 21 and total.prompt_tokens == 10 * 210 + 10
    assert total.cost_units == Decimal("213.1")  # 20 x n + 0.1 for n in 1..20, and 1.1
    assert total.refusals["rate"] == 2 and total.refusals["kv"] == 1 and total.refusals["deadline"] == 0
    alpha = await overview(db_engine, window, a.id)
    assert alpha.slo_met == 10 and alpha.slo_attainment == 0.5  # ttft n/10 <= 1.0 for n <= 10

    [row_a, row_b] = await tenant_table(db_engine, window)
    assert (row_a.name, row_a.figures.requests, row_b.figures.requests) == ("alpha", 20, 1)

    series = await tenant_series(db_engine, a.id, window, "hour")
    assert [p.requests for p in series] == [20, 0, 0]
    assert sum(p.cost_units for p in series) == alpha.cost_units

    page, cursor = await ledger_page(db_engine, LedgerFilter(tenant_id=a.id), None, 8)
    seen = [r.request_id for r in page]
    while cursor is not None:
        page, cursor = await ledger_page(db_engine, LedgerFilter(tenant_id=a.id), cursor, 8)
        seen += [r.request_id for r in page]
    assert seen == [f"req-{a.id}-{n}" for n in range(20, 0, -1)]
    errors, _ = await ledger_page(db_engine, LedgerFilter(status="error"), None, 10)
    assert [r.tenant_name for r in errors] == ["beta"]
    entry = await ledger_entry(db_engine, f"req-{a.id}-3")
    assert entry is not None and entry.key_prefix == key.prefix and entry.cost_units == Decimal("3.1")
    assert await ledger_entry(db_engine, "nope") is None
    with pytest.raises(InvalidValue):
        await ledger_page(db_engine, LedgerFilter(), "garbage!", 10)
    with pytest.raises(InvalidValue):
        Window(T0, T0)


async def test_a_series_holds_at_most_500_points(db_engine):
    tenant = await create_tenant(db_engine, "gamma")
    start = datetime(2025, 1, 1, 6, tzinfo=UTC)  # not a midnight: the first day counts from its start
    longest = Window(start, start + timedelta(days=499))
    assert series_length(longest, "day") == MAX_SERIES_POINTS == 500
    assert len(await tenant_series(db_engine, tenant.id, longest, "day")) == 500
    too_long = Window(start, start + timedelta(days=499, hours=19))
    assert series_length(too_long, "day") == 501
    with pytest.raises(InvalidValue, match="at most 500 days, not 501"):
        await tenant_series(db_engine, tenant.id, too_long, "day")
    fifty_days = Window(start, start + timedelta(days=50, minutes=1))
    with pytest.raises(InvalidValue, match="at most 500 hours, not 1201"):
        await tenant_series(db_engine, tenant.id, fifty_days, "hour")
