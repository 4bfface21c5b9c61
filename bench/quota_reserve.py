"""Quota microbenchmark: reserve+settle pairs per second and their latency against the local PostgreSQL.

    .venv/bin/python bench/quota_reserve.py [--seconds 3] [--concurrency 32] [--skip-direct]

Runs in a scratch database on ``DATABASE_URL`` or Weir's embedded server (dropped afterwards). Each
scenario runs 1 and then 2 OS processes at once, each with ``--concurrency`` coroutines in a closed loop
(reserve a worst case of 1,000 cost units, settle a random actual cost, yield), for load spread over 100
tenants and for one hot tenant. Latency is one reserve plus its settle. Two designs side by side:

- ``leased``: Weir's ``QuotaManager`` (per-process leases of budget slices, tenants/quotas.py);
- ``direct``: the same SQL functions with one row update per reserve and one per settle (no slices),
  the design that locks up on a hot tenant's row.

The table also shows database round trips per second and the share of pairs whose reservation waited
for the database (the rest are served from the process's slice without I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import format_table  # noqa: E402
from bench.scratch_db import scratch_database  # noqa: E402
from tenants.db import create_engine  # noqa: E402
from tenants.quotas import ACQUIRE_SQL, RETURN_SQL, QuotaManager, Reservation, quota_engine  # noqa: E402

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

WORST_CASE = 1000.0
TARGETS = {"spread": 2000.0, "hot": 1000.0}
P99_TARGET_MS = 5.0


@dataclass(frozen=True)
class Result:
    design: str
    scenario: str
    processes: int
    pairs_per_s: float
    p50_ms: float
    p99_ms: float
    round_trips_per_s: float
    waited_pct: float  # share of pairs whose reservation waited for the database
    refused: int


class DirectQuota:
    """One row update per reserve and per settle: what the leases avoid (same SQL functions and the same
    autocommit engine as ``QuotaManager``, but no slices)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.holder = uuid.uuid4().hex
        self.round_trips = 0

    async def pair(self, tenant_id: int, actual: float) -> bool:
        self.round_trips += 2
        acquire = {
            "tenant": tenant_id,
            "holder": self.holder,
            "cost": WORST_CASE,
            "need_cost": WORST_CASE,
            "need_slots": 1,
            "extra_cost": 0.0,
            "extra_slots": 0,
            "consumed": 0.0,
            "lease_s": 30.0,
        }
        async with self.engine.connect() as conn:
            row = (await conn.execute(ACQUIRE_SQL, acquire)).one()
        if row.reason is not None:
            return False
        settle = {
            "holder": self.holder,
            "tenants": [tenant_id],
            "cost": [WORST_CASE - actual],
            "slots": [1],
            "consumed": [actual],
            "lease_s": 30.0,
            "close": False,
        }
        async with self.engine.connect() as conn:
            await conn.execute(RETURN_SQL, settle)
        return True


async def _worker(
    url: str, design: str, tenant_ids: list[int], start_at: float, seconds: float, concurrency: int
) -> dict:
    engine = create_engine(url)
    manager = QuotaManager(engine) if design == "leased" else None
    direct = DirectQuota(quota_engine(engine, pool_size=concurrency)) if design == "direct" else None
    latencies: list[float] = []
    refused = 0
    rng = random.Random(os.getpid())
    stop_at = start_at + seconds

    async def one_pair(tenant: int | None = None) -> bool:
        tenant = tenant if tenant is not None else rng.choice(tenant_ids)
        actual = rng.uniform(100.0, WORST_CASE)
        if direct is not None:
            return await direct.pair(tenant, actual)
        result = await manager.reserve(tenant, WORST_CASE)
        if not isinstance(result, Reservation):
            return False
        manager.settle(result, actual)
        return True

    async def loop() -> None:
        nonlocal refused
        while (now := time.time()) < stop_at:
            began = time.perf_counter()
            granted = await one_pair()
            if now >= start_at:
                latencies.append(time.perf_counter() - began)
                refused += not granted
            await asyncio.sleep(0)

    # warm the connection pool and every tenant's slice: the table is about the steady state
    await asyncio.gather(*(one_pair(tenant) for tenant in tenant_ids for _ in range(2)))
    trips_before = manager.round_trips if manager else direct.round_trips
    waits_before = manager.waits if manager else 0
    await asyncio.sleep(max(0.0, start_at - time.time()))
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    trips = (manager.round_trips if manager else direct.round_trips) - trips_before
    waits = manager.waits - waits_before if manager else len(latencies)  # direct: every pair waits
    if manager is not None:
        await manager.close()
    else:
        await direct.engine.dispose()
    await engine.dispose()
    return {"latencies": latencies, "refused": refused, "round_trips": trips, "waits": waits}


def _run_processes(
    url: str, design: str, tenant_ids: list[int], processes: int, seconds: float, concurrency: int
) -> Result:
    start_at = time.time() + 4.0  # every process connected and warm before the clock starts
    args = [
        sys.executable,
        __file__,
        "--worker",
        url,
        design,
        ",".join(map(str, tenant_ids)),
        str(start_at),
        str(seconds),
        str(concurrency),
    ]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    outputs = [json.loads(p.communicate()[0]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("quota_reserve: a worker process failed")
    latencies = sorted(x for out in outputs for x in out["latencies"])
    q = statistics.quantiles(latencies, n=100, method="inclusive")
    return Result(
        design=design,
        scenario="hot" if len(tenant_ids) == 1 else "spread",
        processes=processes,
        pairs_per_s=len(latencies) / seconds,
        p50_ms=q[49] * 1000,
        p99_ms=q[98] * 1000,
        round_trips_per_s=sum(out["round_trips"] for out in outputs) / seconds,
        waited_pct=100.0 * sum(out["waits"] for out in outputs) / max(1, len(latencies)),
        refused=sum(out["refused"] for out in outputs),
    )


async def _setup(url: str, tenants: int) -> tuple[list[int], int]:
    from tenants.admin import create_tenant
    from tenants.records import Quotas

    engine = create_engine(url)
    quota = Quotas(cost_per_minute=1e12, max_concurrency=100_000, monthly_budget=1e15)
    try:
        spread = [(await create_tenant(engine, f"spread-{i}", quota=quota)).id for i in range(tenants)]
        hot = (await create_tenant(engine, "hot", quota=quota)).id
    finally:
        await engine.dispose()
    return spread, hot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per run")
    parser.add_argument("--concurrency", type=int, default=32, help="coroutines per process")
    parser.add_argument("--tenants", type=int, default=100, help="tenants in the spread scenario")
    parser.add_argument("--skip-direct", action="store_true", help="only the leased design")
    args = parser.parse_args()
    if args.seconds <= 0 or args.concurrency < 1 or args.tenants < 1:
        raise SystemExit("quota_reserve: error: --seconds, --concurrency and --tenants must be positive")

    results: list[Result] = []
    with scratch_database() as url:
        spread, hot = asyncio.run(_setup(url, args.tenants))
        designs = ["leased"] if args.skip_direct else ["leased", "direct"]
        for design in designs:
            for tenant_ids in (spread, [hot]):
                for processes in (1, 2):
                    result = _run_processes(
                        url, design, tenant_ids, processes, args.seconds, args.concurrency
                    )
                    print(
                        f"  {design} {result.scenario} x{processes}: {result.pairs_per_s:.0f} pairs/s",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(result)

    print(
        f"quota reserve+settle, {args.concurrency} coroutines per process, {args.seconds:g} s per run, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    rows = []
    for r in results:
        target = TARGETS[r.scenario]
        ok = r.pairs_per_s >= target and r.p99_ms < P99_TARGET_MS
        rows.append(
            (
                r.design,
                r.scenario,
                r.processes,
                round(r.pairs_per_s),
                target,
                r.p50_ms,
                r.p99_ms,
                round(r.round_trips_per_s),
                r.waited_pct,
                r.refused,
                "yes" if ok else "no",
            )
        )
    print(
        format_table(
            (
                "design",
                "load",
                "procs",
                "pairs/s",
                "target",
                "p50 ms",
                "p99 ms",
                "db trips/s",
                "waited %",
                "refused",
                "meets target",
            ),
            rows,
        )
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, design, ids, start_at, seconds, concurrency = sys.argv[2:]
        out = asyncio.run(
            _worker(
                url,
                design,
                [int(i) for i in ids.split(",")],
                float(start_at),
                float(seconds),
                int(concurrency),
            )
        )
        print(json.dumps(out))
        sys.exit(0)
    sys.exit(main())
