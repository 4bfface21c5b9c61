"""Hourly and daily rollups of the usage and refusal ledgers, kept up to date from marks.

Every insert into ``usage_events`` or ``shed_events`` marks the UTC hours of its rows in ``rollup_marks``
(a trigger, in the inserting transaction). :func:`refresh_rollups` takes the marks, recomputes each marked
hour from the raw rows, then each day holding a marked hour from its hours, and deletes the marks it took,
all in one transaction. Recomputing replaces the period's rows, so it is idempotent: an hour recomputed
twice, or an event replayed from a spill file days later (it marks its own hour), gives the same rows as
if every event had arrived on time. Refreshes are serialized by an advisory lock.

Latency histograms (``latency_rollups``: per period, tenant, metric and bucket, the requests in the bucket)
have :data:`LATENCY_BUCKETS` fixed buckets, numbered from 0 (SQL: ``weir_latency_bucket``): the first counts
values below 1 ms, the last (73) values of ``2**18`` ms (262 s) and more, and bucket ``i`` between
covers ``[1 ms * 2**((i-1)/4), 1 ms * 2**(i/4))``, a quarter of an octave. A percentile is
read as the geometric middle of the bucket that holds it (nearest rank), within a factor ``2**(1/8)``
(+-9%) of the exact value between 1 ms and 262 s.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

LATENCY_BUCKETS = 74
_LOCK_KEY = 0x77_65_69_72_72_6F  # pg_advisory_xact_lock key of the refresh ("weirro")
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)

# Whether a request met its tenant's targets (raw row ``e`` joined with its tenant ``t``): a first token
# within the TTFT target and, when it produced more than one token, a mean TPOT within the TPOT target.
SLO_MET_SQL = "e.ttft_s <= t.ttft_target_s AND (e.tpot_s IS NULL OR e.tpot_s <= t.tpot_target_s)"

# A request's two latencies as (metric, seconds) rows (raw row ``e``); the histograms count non-NULL ones.
LATENCIES_SQL = "VALUES ('ttft', e.ttft_s), ('tpot', e.tpot_s)"

_HOURS_SQL = [
    "DELETE FROM usage_rollups WHERE granularity = 'hour' AND period_start = ANY(:periods)",
    f"""
INSERT INTO usage_rollups
SELECT 'hour', h.start, e.tenant_id, e.key_id, e.model, count(*), sum(e.prompt_tokens),
       sum(e.cached_tokens), sum(e.output_tokens), sum(e.cost), count(*) FILTER (WHERE {SLO_MET_SQL})
FROM unnest(CAST(:periods AS timestamptz[])) AS h(start)
JOIN usage_events AS e ON e.finished_at >= h.start AND e.finished_at < h.start + interval '1 hour'
LEFT JOIN tenants AS t ON t.id = e.tenant_id
GROUP BY h.start, e.tenant_id, e.key_id, e.model""",
    "DELETE FROM latency_rollups WHERE granularity = 'hour' AND period_start = ANY(:periods)",
    f"""
INSERT INTO latency_rollups
SELECT 'hour', h.start, e.tenant_id, m.metric, weir_latency_bucket(m.seconds), count(*)
FROM unnest(CAST(:periods AS timestamptz[])) AS h(start)
JOIN usage_events AS e ON e.finished_at >= h.start AND e.finished_at < h.start + interval '1 hour'
CROSS JOIN LATERAL ({LATENCIES_SQL}) AS m(metric, seconds)
WHERE m.seconds IS NOT NULL
GROUP BY 1, 2, 3, 4, 5""",
    "DELETE FROM shed_rollups WHERE granularity = 'hour' AND period_start = ANY(:periods)",
    """
INSERT INTO shed_rollups
SELECT 'hour', h.start, s.tenant_id, s.reason, count(*)
FROM unnest(CAST(:periods AS timestamptz[])) AS h(start)
JOIN shed_events AS s ON s.at >= h.start AND s.at < h.start + interval '1 hour'
GROUP BY h.start, s.tenant_id, s.reason""",
]

_DAYS_SQL = [
    "DELETE FROM usage_rollups WHERE granularity = 'day' AND period_start = ANY(:periods)",
    """
INSERT INTO usage_rollups
SELECT 'day', d.start, r.tenant_id, r.key_id, r.model, sum(r.requests), sum(r.prompt_tokens),
       sum(r.cached_tokens), sum(r.output_tokens), sum(r.cost), sum(r.slo_met)
FROM unnest(CAST(:periods AS timestamptz[])) AS d(start)
JOIN usage_rollups AS r ON r.granularity = 'hour' AND r.period_start >= d.start
     AND r.period_start < d.start + interval '24 hours'
GROUP BY d.start, r.tenant_id, r.key_id, r.model""",
    "DELETE FROM latency_rollups WHERE granularity = 'day' AND period_start = ANY(:periods)",
    """
INSERT INTO latency_rollups
SELECT 'day', d.start, r.tenant_id, r.metric, r.bucket, sum(r.requests)
FROM unnest(CAST(:periods AS timestamptz[])) AS d(start)
JOIN latency_rollups AS r ON r.granularity = 'hour' AND r.period_start >= d.start
     AND r.period_start < d.start + interval '24 hours'
GROUP BY 1, 2, 3, 4, 5""",
    "DELETE FROM shed_rollups WHERE granularity = 'day' AND period_start = ANY(:periods)",
    """
INSERT INTO shed_rollups
SELECT 'day', d.start, r.tenant_id, r.reason, sum(r.refusals)
FROM unnest(CAST(:periods AS timestamptz[])) AS d(start)
JOIN shed_rollups AS r ON r.granularity = 'hour' AND r.period_start >= d.start
     AND r.period_start < d.start + interval '24 hours'
GROUP BY d.start, r.tenant_id, r.reason""",
]


async def refresh_rollups(db: AsyncEngine) -> int:
    """Recompute every marked hour and its day; returns the number of hours recomputed."""
    async with db.begin() as conn:
        if (await conn.execute(sa.text("SELECT 1 FROM rollup_marks LIMIT 1"))).first() is None:
            return 0
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
        marks = (await conn.execute(sa.text("SELECT id, hour FROM rollup_marks"))).all()
        if not marks:  # taken by the refresh this one waited for
            return 0
        hours = sorted({hour for _, hour in marks})
        days = sorted({hour.replace(hour=0) for hour in hours})
        for statement in _HOURS_SQL:
            await conn.execute(sa.text(statement), {"periods": hours})
        for statement in _DAYS_SQL:
            await conn.execute(sa.text(statement), {"periods": days})
        await conn.execute(
            sa.text("DELETE FROM rollup_marks WHERE id = ANY(:ids)"),
            {"ids": [mark_id for mark_id, _ in marks]},
        )
    return len(hours)


def latency_bucket(seconds: float) -> int:
    """The histogram bucket of a latency (as the SQL function ``weir_latency_bucket`` computes it)."""
    if seconds < 0.001:
        return 0
    return min(LATENCY_BUCKETS - 1, 1 + math.floor(4 * math.log(seconds / 0.001) / math.log(2)))


def bucket_value(bucket: int) -> float:
    """The latency a bucket stands for: its geometric middle (0.5 ms for the first, 262 s for the last)."""
    if bucket == 0:
        return 0.0005
    if bucket == LATENCY_BUCKETS - 1:
        return 0.001 * 2 ** ((bucket - 1) / 4)
    return 0.001 * 2 ** ((bucket - 0.5) / 4)


def percentile(histogram: list[int], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of a histogram, ``None`` when it is empty."""
    total = sum(histogram)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bucket, count in enumerate(histogram):
        seen += count
        if seen >= rank:
            return bucket_value(bucket)
    raise AssertionError("unreachable: rank <= total")


def floor_to(moment: datetime, step: timedelta) -> datetime:
    """``moment`` (UTC) truncated to the hour or the UTC day."""
    moment = moment.replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if step == DAY else moment


def ceil_to(moment: datetime, step: timedelta) -> datetime:
    floor = floor_to(moment, step)
    return floor if floor == moment else floor + step
