"""`weir bench dashboard`: the admin pages and the billing export on a ledger of a million requests.

Fills a scratch database (on ``DATABASE_URL`` or Weir's embedded server; dropped afterwards) with
``--rows`` requests over the last ``--days`` days for ``--tenants`` tenants (tenants/traffic.py, by COPY),
builds the rollups, then:

- times each admin page over HTTP (the dashboard router in a uvicorn server of its own, signed in with an
  admin token), ``--repeat`` times each after one warm-up, sequentially: p50 and p95;
- streams the whole range as CSV per request and per hour and reports rows per second.

``--out F`` writes ``{"ledger_rows", "pages": {PATH: {"p50_ms", "p95_ms"}}, "export_rows_per_s", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import re
import socket
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from bench.report import format_table, write_json

if TYPE_CHECKING:
    import httpx
    from sqlalchemy.ext.asyncio import AsyncEngine

PAGE_TARGET_MS = 300.0
EXPORT_TARGET_ROWS_PER_S = 100_000.0
ADMIN_TOKEN = "bench-admin-token-" + uuid.uuid4().hex


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.asynccontextmanager
async def _dashboard_server(db: AsyncEngine) -> AsyncIterator[str]:
    """The dashboard router alone in a uvicorn server on a free local port; yields its base URL."""
    import uvicorn
    from litestar import Litestar

    from dashboard import DashboardSources, dashboard_router, template_config

    sources = DashboardSources(
        database=lambda: db,
        engine_stats=lambda: None,
        model_name=lambda: "synthetic",
        admin_token=ADMIN_TOKEN,
    )
    app = Litestar(route_handlers=[dashboard_router(sources)], template_config=template_config())
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


async def _sign_in(client: httpx.AsyncClient) -> None:
    form = await client.get("/admin/login")
    csrf = re.search(r'name="_csrf_token"\s+value="([^"]+)"', form.text)
    if csrf is None:
        raise SystemExit("weir bench dashboard: error: the sign-in form has no CSRF field")
    done = await client.post("/admin/login", data={"token": ADMIN_TOKEN, "_csrf_token": csrf.group(1)})
    if done.status_code >= 400:
        raise SystemExit(f"weir bench dashboard: error: sign-in refused ({done.status_code})")


async def _time_pages(base_url: str, paths: list[str], repeat: int) -> dict[str, dict[str, float]]:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    pages = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=120, follow_redirects=True) as client:
        await _sign_in(client)
        for path in paths:
            times = []
            for attempt in range(repeat + 1):
                start = time.perf_counter()
                response = await client.get(path)
                elapsed = (time.perf_counter() - start) * 1000
                if response.status_code != 200:
                    raise SystemExit(f"weir bench dashboard: error: GET {path} gave {response.status_code}")
                if attempt:
                    times.append(elapsed)
            times.sort()
            pages[path] = {
                "p50_ms": round(statistics.median(times), 1),
                "p95_ms": round(times[min(len(times) - 1, math.ceil(0.95 * len(times)) - 1)], 1),
            }
            print(f"  {path}: p50 {pages[path]['p50_ms']} ms", flush=True)
    return pages


async def _export_rate(
    db: AsyncEngine, since: datetime, until: datetime, granularity: str
) -> tuple[int, float]:
    """Rows of the CSV export of ``[since, until)`` and the rows per second it streamed at."""
    from tenants.exports import csv_chunks, export_rows

    start = time.perf_counter()
    lines = 0
    async for chunk in csv_chunks(export_rows(db, since, until, granularity)):
        lines += chunk.count("\n")
    elapsed = time.perf_counter() - start
    return lines - 1, (lines - 1) / elapsed


async def _pages(db: AsyncEngine) -> list[str]:
    """The pages to time: overview and tenants over each span, the largest tenant, the request log."""
    from tenants.reporting import LedgerFilter, ledger_page

    [newest], cursor = await ledger_page(db, LedgerFilter(), None, 1)
    paths = [f"/admin?range={span}" for span in ("24h", "7d", "30d")]
    paths += [f"/admin/tenants?range={span}" for span in ("24h", "30d")]
    paths += ["/admin/tenants/tenant-00?range=24h", "/admin/tenants/tenant-00?range=30d"]
    paths += ["/admin/requests", "/admin/requests?tenant=tenant-07", f"/admin/requests/{newest.request_id}"]
    return [*paths, "/admin/exports"]


async def _run(url: str, args: argparse.Namespace) -> dict:
    from tenants.db import create_engine
    from tenants.traffic import bench_tenants, fill

    db = create_engine(url)
    try:
        until = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
        since = until - timedelta(days=args.days)
        start = time.perf_counter()
        rows, refusals = await fill(db, bench_tenants(args.tenants), since, until, args.rows, seed=1)
        fill_s = time.perf_counter() - start
        print(
            f"  ledger: {rows} requests, {refusals} refusals in {fill_s:.1f} s (COPY + rollups)", flush=True
        )
        exports = {}
        for granularity in ("request", "hour"):
            exports[granularity] = await _export_rate(db, since, until, granularity)
            print(f"  export per {granularity}: {exports[granularity][1]:,.0f} rows/s", flush=True)
        async with _dashboard_server(db) as base_url:
            pages = await _time_pages(base_url, await _pages(db), args.repeat)
    finally:
        await db.dispose()
    return {
        "ledger_rows": rows,
        "refusal_rows": refusals,
        "fill_s": round(fill_s, 1),
        "pages": pages,
        "export_rows_per_s": round(exports["request"][1]),
        "exports": {g: {"rows": n, "rows_per_s": round(rate)} for g, (n, rate) in exports.items()},
    }


def main(args: argparse.Namespace) -> int:
    from bench.scratch_db import scratch_database

    if args.rows < 1 or args.days < 1 or args.tenants < 1 or args.repeat < 1:
        raise SystemExit(
            "weir bench dashboard: error: --rows, --days, --tenants and --repeat must be positive"
        )
    with scratch_database() as url:
        result = asyncio.run(_run(url, args))
    print(
        f"admin dashboard on {result['ledger_rows']:,} ledger rows over {args.days} days, {args.tenants} "
        f"tenants; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    rows = [
        (path, t["p50_ms"], t["p95_ms"], PAGE_TARGET_MS, "yes" if t["p95_ms"] < PAGE_TARGET_MS else "NO")
        for path, t in result["pages"].items()
    ]
    print(format_table(("page", "p50 ms", "p95 ms", "target p95 ms", "met"), rows))
    print()
    export_rows = [
        (
            granularity,
            e["rows"],
            e["rows_per_s"],
            EXPORT_TARGET_ROWS_PER_S if granularity == "request" else None,
        )
        for granularity, e in result["exports"].items()
    ]
    print(format_table(("CSV export per", "rows", "rows/s", "target rows/s"), export_rows))
    if args.out:
        write_json(args.out, result)
    return 0
