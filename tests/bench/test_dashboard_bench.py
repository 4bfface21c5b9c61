"""``weir bench dashboard`` end to end on a small ledger: a scratch database filled and dropped, every
page served over HTTP, the export counted, and the result file in the documented shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.fixtures.database import plain_dsn

ROOT = Path(__file__).resolve().parents[2]


async def _databases(server_url: str) -> set[str]:
    conn = await asyncpg.connect(plain_dsn(server_url))
    try:
        return {row[0] for row in await conn.fetch("SELECT datname FROM pg_database")}
    finally:
        await conn.close()


async def test_bench_dashboard_on_a_small_ledger(pg_server_url, tmp_path):
    before = await _databases(pg_server_url)
    out = tmp_path / "dashboard.json"
    env = {**os.environ, "DATABASE_URL": pg_server_url, "WEIR_STATE_DIR": str(tmp_path / "state")}
    args = ["--rows", "3000", "--days", "3", "--tenants", "8", "--repeat", "2", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "api.cli", "bench", "dashboard", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["ledger_rows"] == 3000 and result["exports"]["request"]["rows"] == 3000
    assert result["export_rows_per_s"] > 0
    assert {"/admin?range=30d", "/admin/tenants?range=30d", "/admin/requests", "/admin/exports"} <= set(
        result["pages"]
    )
    for timing in result["pages"].values():
        assert 0 < timing["p50_ms"] <= timing["p95_ms"]
    assert "p95 ms" in done.stdout and "rows/s" in done.stdout
    left = {name for name in await _databases(pg_server_url) - before if name.startswith("weir_bench_")}
    assert left == set()  # the scratch database is gone
