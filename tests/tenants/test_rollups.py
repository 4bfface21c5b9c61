"""Rollups: recomputing gives the same rows, concurrent refreshes do not collide, late events land in their
hour, and the histogram buckets are the same in SQL and Python, within the documented error."""

from __future__ import annotations

import asyncio
import math
import random

import sqlalchemy as sa

from tenants.rollups import LATENCY_BUCKETS, bucket_value, latency_bucket, percentile, refresh_rollups
from tenants.usage import write_events
from tests.tenants.ledger_data import ledger_tenants, shed_events, usage_events

TABLES = ("usage_rollups", "shed_rollups", "latency_rollups")


async def _snapshot(db_engine) -> dict[str, list]:
    async with db_engine.connect() as conn:
        return {
            table: sorted(map(tuple, (await conn.execute(sa.text(f"SELECT * FROM {table}"))).all()), key=repr)
            for table in TABLES
        }


async def test_recomputing_and_late_events_give_the_rows_of_one_pass(db_engine):
    rng = random.Random(4)
    _, tenants = await ledger_tenants(db_engine)
    events, sheds = usage_events(rng, tenants, 600), shed_events(rng, tenants, 80)
    await write_events(db_engine, events[:300] + sheds[:40])
    assert await refresh_rollups(db_engine) > 0
    await write_events(db_engine, events[300:] + sheds[40:])  # late, into hours already rolled up
    await asyncio.gather(refresh_rollups(db_engine), refresh_rollups(db_engine))  # serialized, no clash
    assert await refresh_rollups(db_engine) == 0
    incremental = await _snapshot(db_engine)

    async with db_engine.begin() as conn:  # every hour marked again: a full recomputation
        await conn.execute(
            sa.text(
                "INSERT INTO rollup_marks (hour) SELECT DISTINCT date_trunc('hour', finished_at, 'UTC') "
                "FROM usage_events"
            )
        )
    await refresh_rollups(db_engine)
    assert await _snapshot(db_engine) == incremental
    async with db_engine.connect() as conn:
        days = (
            await conn.execute(sa.text("SELECT sum(requests) FROM usage_rollups WHERE granularity = 'day'"))
        ).scalar()
    assert days == len(events)


async def test_buckets_agree_with_sql_and_bound_the_error(db_engine):
    rng = random.Random(2)
    values = [0.0, 0.0009999, 0.001, 0.25, 1.0, 262.144, 1e6] + [
        rng.lognormvariate(-2, 2) for _ in range(300)
    ]
    async with db_engine.connect() as conn:
        query = sa.text("SELECT weir_latency_bucket(v) FROM unnest(CAST(:values AS float8[])) AS v")
        in_sql = (await conn.execute(query, {"values": values})).scalars().all()
    assert in_sql == [latency_bucket(v) for v in values]
    for value in values:
        bucket = latency_bucket(value)
        assert 0 <= bucket < LATENCY_BUCKETS
        if 0.001 <= value < 0.001 * 2**18:
            assert 2 ** (-1 / 8) <= bucket_value(bucket) / value <= 2 ** (1 / 8)
    histogram = [0] * LATENCY_BUCKETS
    for value in values:
        histogram[latency_bucket(value)] += 1
    ranked = sorted(values)
    assert percentile(histogram, 0.5) == bucket_value(
        latency_bucket(ranked[math.ceil(0.5 * len(values)) - 1])
    )
    assert percentile([0] * LATENCY_BUCKETS, 0.5) is None
