"""Every figure the reporting module gives equals the sum over the raw ledger, to the token and the last
digit of cost, for random windows and filters, including events that arrive late for rolled-up hours."""

from __future__ import annotations

import math
import random
from datetime import timedelta
from decimal import Decimal

from tenants.models import SHED_REASONS
from tenants.reporting import Window, overview, tenant_series, tenant_table
from tenants.rollups import refresh_rollups
from tenants.usage import write_events
from tests.tenants.ledger_data import SPAN, START, ledger_tenants, moment, shed_events, usage_events


def _nearest_rank(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return sorted(values)[max(1, math.ceil(q * len(values))) - 1]


def _close(reported: float | None, exact: float | None) -> bool:
    """Within the histogram's error: the same quarter-octave bucket (below 1 ms: both below 1 ms)."""
    if reported is None or exact is None:
        return reported is exact
    if exact < 0.001:
        return reported < 0.001
    return 2 ** (-1 / 8) - 1e-9 <= reported / exact <= 2 ** (1 / 8) + 1e-9


def _check(figures, events, sheds, window, targets, tenant_id=None) -> None:
    chosen = [
        e for e in events if window.since <= e.finished_at < window.until and tenant_id in (None, e.tenant_id)
    ]
    assert figures.requests == len(chosen)
    for name in ("prompt_tokens", "cached_tokens", "output_tokens"):
        assert getattr(figures, name) == sum(getattr(e, name) for e in chosen), name
    assert figures.cost_units == sum((e.cost for e in chosen), Decimal(0))
    met = [
        e
        for e in chosen
        if e.ttft_s is not None
        and e.ttft_s <= targets[e.tenant_id][0]
        and (e.tpot_s is None or e.tpot_s <= targets[e.tenant_id][1])
    ]
    assert figures.slo_met == len(met)
    for metric in ("ttft", "tpot"):
        values = [getattr(e, f"{metric}_s") for e in chosen if getattr(e, f"{metric}_s") is not None]
        for q in (50, 99):
            assert _close(getattr(figures, f"{metric}_p{q}"), _nearest_rank(values, q / 100)), (metric, q)
    refused = [s for s in sheds if window.since <= s.at < window.until and tenant_id in (None, s.tenant_id)]
    assert figures.refusals == {r: sum(s.reason == r for s in refused) for r in SHED_REASONS}


def _window(rng: random.Random) -> Window:
    kind = rng.choice(["any", "hours", "days", "short"])
    since = moment(rng) - timedelta(hours=6)
    if kind == "hours":
        since = since.replace(minute=0, second=0, microsecond=0)
        return Window(since, since + timedelta(hours=rng.randint(1, 60)))
    if kind == "days":
        since = since.replace(hour=0, minute=0, second=0, microsecond=0)
        return Window(since, since + timedelta(days=rng.randint(1, 3)))
    length = timedelta(minutes=rng.uniform(1, 50)) if kind == "short" else rng.uniform(0.01, 1.2) * SPAN
    return Window(since, since + length)


async def test_reporting_totals_equal_the_raw_ledger(db_engine):
    rng = random.Random(9)
    targets, tenants = await ledger_tenants(db_engine)
    events = usage_events(rng, tenants, 1500)
    sheds = shed_events(rng, tenants, 300)
    await write_events(db_engine, events[:1000] + sheds[:200])
    await refresh_rollups(db_engine)
    # late events (a replayed spill file) land in hours already rolled up; a replayed batch counts once
    await write_events(db_engine, events[1000:] + sheds[200:])
    await write_events(db_engine, events[900:1100] + sheds[150:250])

    for _ in range(30):
        window = _window(rng)
        tenant_id = rng.choice([None, *targets])
        _check(await overview(db_engine, window, tenant_id), events, sheds, window, targets, tenant_id)

    window = Window(START + timedelta(hours=7, minutes=13), START + timedelta(days=3, hours=2, seconds=9))
    for row in await tenant_table(db_engine, window):
        _check(row.figures, events, sheds, window, targets, row.tenant_id)
    tenant_id = tenants[0][0]
    for step, size in (("hour", timedelta(hours=1)), ("day", timedelta(days=1))):
        points = await tenant_series(db_engine, tenant_id, window, step)
        assert points[0].period_start <= window.since < points[0].period_start + size
        assert all(b.period_start - a.period_start == size for a, b in zip(points, points[1:], strict=False))
        assert points[-1].period_start < window.until <= points[-1].period_start + size
        for point in points:
            piece = Window(
                max(point.period_start, window.since), min(point.period_start + size, window.until)
            )
            exact = await overview(db_engine, piece, tenant_id)
            assert (point.requests, point.cost_units, point.refusals) == (
                exact.requests,
                exact.cost_units,
                exact.refusals,
            )
            assert (point.ttft_p50, point.ttft_p99, point.tpot_p50, point.tpot_p99) == (
                exact.ttft_p50,
                exact.ttft_p99,
                exact.tpot_p50,
                exact.tpot_p99,
            )
        whole = await overview(db_engine, window, tenant_id)
        assert sum(p.requests for p in points) == whole.requests
        assert sum((p.cost_units for p in points), Decimal(0)) == whole.cost_units
