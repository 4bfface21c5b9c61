"""Reservations: exact limits under concurrency, settle, release, extend, budget refusals, dead-holder
reclaim, and the allowance a tenant has left."""

from __future__ import annotations

import asyncio
import contextvars
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from tenants.admin import create_tenant
from tenants.background import run_background_in
from tenants.quotas import Allowance, Limit, QuotaManager, Refusal, Reservation
from tenants.records import Quotas

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("quota_worker.py")


async def _state(engine, tenant_id: int):
    async with engine.connect() as conn:
        return (
            await conn.execute(
                sa.text("SELECT bucket_level, in_flight, period_spent FROM quota_state WHERE tenant_id = :t"),
                {"t": tenant_id},
            )
        ).one()


async def test_concurrent_tasks_get_exactly_the_concurrency_limit(db_engine):
    tenant = await create_tenant(db_engine, "hot", quota=Quotas(cost_per_minute=1000, max_concurrency=60))
    manager = QuotaManager(db_engine)
    results = await asyncio.gather(*(manager.reserve(tenant.id, 10.0) for _ in range(200)))
    granted = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, Refusal)]
    assert len(granted) == 60  # one process holds all it takes: no slice elsewhere can refuse it
    assert {(r.reason, r.limit) for r in refused} == {("concurrency", 60)}
    for reservation in granted:
        manager.settle(reservation, 4.0)
    await manager.close()
    level, in_flight, spent = await _state(db_engine, tenant.id)
    assert in_flight == 0 and abs(spent - 240.0) < 1e-6
    assert 760 - 1e-6 <= level <= 1000


async def test_settle_returns_unused_and_release_returns_all(db_engine):
    tenant = await create_tenant(
        db_engine, "acme", quota=Quotas(cost_per_minute=600, max_concurrency=5, monthly_budget=10_000)
    )
    manager = QuotaManager(db_engine)
    first = await manager.reserve(tenant.id, 100.0)
    second = await manager.reserve(tenant.id, 50.0)
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    assert manager.settle(first, 30.0)
    assert not manager.settle(first, 30.0)  # nothing is charged twice
    assert manager.release(second)
    await manager.close()
    level, in_flight, spent = await _state(db_engine, tenant.id)
    assert in_flight == 0
    assert abs(spent - 30.0) < 1e-6
    # 30 used from a full bucket of 600 (plus at most a little refill, capped at 600)
    assert 570 - 1e-6 <= level <= 600


async def test_monthly_budget_refuses_with_its_own_reason(db_engine):
    tenant = await create_tenant(db_engine, "small", quota=Quotas(monthly_budget=100, cost_per_minute=10_000))
    manager = QuotaManager(db_engine)
    granted = await manager.reserve(tenant.id, 80.0)
    assert isinstance(granted, Reservation)
    refusal = await manager.reserve(tenant.id, 30.0)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "budget" and not refusal.retryable
    assert refusal.limit == 100 and refusal.remaining <= 20 + 1e-6 and refusal.reset_s > 0
    manager.settle(granted, 10.0)
    await manager.sync(close=True)
    assert isinstance(await manager.reserve(tenant.id, 30.0), Reservation)
    await manager.close()


async def test_rate_refusal_says_when_to_retry(db_engine):
    tenant = await create_tenant(db_engine, "slow", quota=Quotas(cost_per_minute=60))
    manager = QuotaManager(db_engine)
    assert isinstance(await manager.reserve(tenant.id, 50.0), Reservation)
    refusal = await manager.reserve(tenant.id, 20.0)
    assert isinstance(refusal, Refusal) and refusal.reason == "rate"
    assert 0 < refusal.retry_after_s <= 10.5 and refusal.reset_s >= refusal.retry_after_s
    too_big = await manager.reserve(tenant.id, 61.0)
    assert isinstance(too_big, Refusal) and too_big.reason == "rate" and not too_big.retryable
    await manager.close()


def _spawn(database_url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(WORKER), database_url, *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


async def test_two_processes_never_exceed_the_allowance(db_engine, database_url):
    quota = Quotas(cost_per_minute=100_000, max_concurrency=500, monthly_budget=1500)
    tenant = await create_tenant(db_engine, "shared", quota=quota)
    procs = [_spawn(database_url, "burst", str(tenant.id), "200", "10") for _ in range(2)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    granted = sum(int(out.split()[0]) for out, _ in outputs)
    assert 0 < granted <= 150  # a budget of 1500 cost units at 10 each (it does not refill)
    assert granted >= 120  # slices idle in the other process refuse at most a tenth each


async def test_dead_holder_is_reclaimed_after_its_lease(db_engine, database_url):
    tenant = await create_tenant(db_engine, "acme", quota=Quotas(max_concurrency=2))
    holder = _spawn(database_url, "hold", str(tenant.id), "2", "3.0")  # a 3 s lease
    assert holder.stdout.readline().strip() == "holding"
    holder.kill()
    holder.wait()
    manager = QuotaManager(db_engine, lease_s=1.0, sync_interval_s=0.05)
    first = await manager.reserve(tenant.id, 1.0)
    assert isinstance(first, Refusal) and first.reason == "concurrency"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while not isinstance(result := await manager.reserve(tenant.id, 1.0), Reservation):
        assert loop.time() < deadline, "dead holder's slots never reclaimed"
        await asyncio.sleep(0.1)
    manager.settle(result, 1.0)
    await manager.close()
    assert (await _state(db_engine, tenant.id)).in_flight == 0


async def _age_state(engine, tenant_id: int, assignment: str) -> None:
    """Move the tenant's bucket clock or budget period into the past, as if time had passed."""
    async with engine.begin() as conn:
        statement = sa.text(f"UPDATE quota_state SET {assignment} WHERE tenant_id = :t")
        await conn.execute(statement, {"t": tenant_id})


async def test_bucket_refills_with_time_and_budget_resets_each_month(db_engine):
    tenant = await create_tenant(db_engine, "acme", quota=Quotas(cost_per_minute=600, monthly_budget=1000))
    manager = QuotaManager(db_engine)
    spent = await manager.reserve(tenant.id, 600.0)
    assert isinstance(spent, Reservation)
    manager.settle(spent, 600.0)
    assert (await manager.reserve(tenant.id, 250.0)).reason == "rate"
    await manager.sync(close=True)
    await _age_state(db_engine, tenant.id, "bucket_updated_at = bucket_updated_at - interval '30 seconds'")
    refilled = await manager.reserve(tenant.id, 250.0)  # 30 s at 10 per second
    assert isinstance(refilled, Reservation)
    manager.settle(refilled, 250.0)
    await manager.sync(close=True)
    await _age_state(db_engine, tenant.id, "bucket_updated_at = bucket_updated_at - interval '1 minute'")
    refusal = await manager.reserve(tenant.id, 200.0)
    assert isinstance(refusal, Refusal) and refusal.reason == "budget" and abs(refusal.remaining - 150) < 1e-6
    await _age_state(db_engine, tenant.id, "period_start = period_start - interval '1 month'")
    assert isinstance(await manager.reserve(tenant.id, 200.0), Reservation)  # a new month
    await manager.close()


def _quiet(engine) -> QuotaManager:
    """A manager whose background sync does not run during a test: its syncs are the test's own."""
    return QuotaManager(engine, lease_s=60.0, sync_interval_s=15.0)


async def test_extend_grows_a_reservation_without_a_slot_and_settles_once(db_engine):
    quota = Quotas(cost_per_minute=6000, max_concurrency=1, monthly_budget=300)
    tenant = await create_tenant(db_engine, "grows", quota=quota)
    manager = _quiet(db_engine)
    reservation = await manager.reserve(tenant.id, 100.0)
    assert isinstance(reservation, Reservation)
    assert await manager.extend(reservation, 150.0) is None  # the one slot is the reservation's own
    assert reservation.cost == 250.0
    refusal = await manager.extend(reservation, 100.0)
    assert isinstance(refusal, Refusal) and refusal.reason == "budget" and refusal.remaining <= 50 + 1e-6
    assert reservation.cost == 250.0  # a refused extension changes nothing
    assert manager.settle(reservation, 240.0)
    with pytest.raises(ValueError, match="settled"):
        await manager.extend(reservation, 1.0)
    await manager.close()
    level, in_flight, spent = await _state(db_engine, tenant.id)
    assert in_flight == 0 and abs(spent - 240.0) < 1e-6


async def test_allowance_follows_reservations_extensions_and_settles(db_engine):
    tenant = await create_tenant(db_engine, "seen", quota=Quotas(cost_per_minute=600, max_concurrency=4))
    manager = _quiet(db_engine)
    start = time.monotonic()
    first = await manager.allowance(tenant.id)
    assert first.rate == Limit(600, 600, 0) and first.concurrency == Limit(4, 4, None)

    def within(allowance: Allowance, expected: float) -> None:
        """The rate allowance is ``expected`` plus at most the bucket's refill (10 per second) since start."""
        rate = allowance.rate
        assert expected - 1e-6 <= rate.remaining <= expected + 10 * (time.monotonic() - start) + 1e-6
        assert abs(rate.reset_s - (600 - rate.remaining) / 10) < 1e-6

    reservation = await manager.reserve(tenant.id, 100.0)
    reserved = await manager.allowance(tenant.id)
    within(reserved, 500)
    assert reserved.concurrency.remaining == 3
    await manager.extend(reservation, 150.0)
    within(await manager.allowance(tenant.id), 350)
    manager.settle(reservation, 200.0)
    await manager.sync()  # gives back and reads the row again: the allowance stays what it was
    settled = await manager.allowance(tenant.id)
    within(settled, 400)
    assert settled.concurrency.remaining == 4
    await manager.close()


async def test_a_first_allowance_read_raced_by_a_grant_is_read_again(db_engine):
    """A grant landing while the tenant's row is read drops that reading (it may predate the grant); the
    allowance reads again rather than answering None, which left a tenant's first answer without its
    ``x-ratelimit-*`` headers."""
    tenant = await create_tenant(db_engine, "raced", quota=Quotas(cost_per_minute=600, max_concurrency=4))
    manager = _quiet(db_engine)
    reads = 0

    def statement(conn, cursor, sql, params, context, executemany) -> None:  # noqa: PLR0913 - the event
        nonlocal reads
        if "FROM quota_state AS s" in sql:
            reads += 1
            if reads == 1:
                manager._slice(tenant.id).moved(0.0, 0)  # as a grant to this process would, mid-read

    sa.event.listen(manager.engine.sync_engine, "before_cursor_execute", statement)
    try:
        allowance = await manager.allowance(tenant.id)
    finally:
        sa.event.remove(manager.engine.sync_engine, "before_cursor_execute", statement)
    assert reads == 2
    assert allowance is not None
    assert allowance.rate.limit == 600 and allowance.concurrency == Limit(4, 4, None)
    await manager.close()


async def test_allowance_sees_another_process_at_its_next_sync(db_engine):
    tenant = await create_tenant(db_engine, "shared", quota=Quotas(cost_per_minute=600, max_concurrency=4))
    here, there = _quiet(db_engine), _quiet(db_engine)
    start = time.monotonic()
    mine = await here.reserve(tenant.id, 100.0)
    theirs = await there.reserve(tenant.id, 50.0)
    assert isinstance(mine, Reservation) and isinstance(theirs, Reservation)
    await there.close()  # gives back its free slice; its reservation stays out
    here.settle(mine, 100.0)
    await here.sync()
    allowance = await here.allowance(tenant.id)
    assert 450 - 1e-6 <= allowance.rate.remaining <= 450 + 10 * (time.monotonic() - start) + 1e-6
    assert allowance.concurrency.remaining == 3
    await here.close()


async def _seen_by_sync(db_engine, name: str, var: contextvars.ContextVar) -> set[object]:
    """``var`` as the quota sync's statements see it, after a reservation made with it set to "request"."""
    seen: list[object] = []
    synced = asyncio.Event()

    def statement(conn, cursor, sql, params, context, executemany) -> None:  # noqa: PLR0913 - the event
        if "weir_quota_return" in sql:
            seen.append(var.get())
            synced.set()

    tenant = await create_tenant(db_engine, name, quota=Quotas(cost_per_minute=600, max_concurrency=4))
    manager = QuotaManager(db_engine, lease_s=1.0, sync_interval_s=0.05)
    sa.event.listen(manager.engine.sync_engine, "before_cursor_execute", statement)
    try:
        var.set("request")
        reservation = await manager.reserve(tenant.id, 10.0)
        assert isinstance(reservation, Reservation)
        assert manager.settle(reservation, 5.0)  # the next sync reports it
        await asyncio.wait_for(synced.wait(), timeout=10)
    finally:
        sa.event.remove(manager.engine.sync_engine, "before_cursor_execute", statement)
        await manager.close()
    assert seen
    return set(seen)


async def test_background_sync_runs_outside_the_request_that_started_it(db_engine):
    """The sync task starts inside the first reservation, but its statements must not run in that caller's
    context (a request's trace would collect every later sync's SQL)."""
    request = contextvars.ContextVar("request", default=None)
    assert await _seen_by_sync(db_engine, "ctx", request) == {None}


async def test_background_work_runs_in_the_context_it_is_given(db_engine):
    """``run_background_in``: the sync runs in a copy of the given context (the API's turns its SQL tracing
    off there), neither in the request's nor in an empty one."""
    marker = contextvars.ContextVar("marker", default=None)
    background = contextvars.Context()
    background.run(marker.set, "background")
    run_background_in(background)
    try:
        assert await _seen_by_sync(db_engine, "ctx-given", marker) == {"background"}
    finally:
        run_background_in(contextvars.Context())
