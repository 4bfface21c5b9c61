"""Helpers for the API tests: the running server's handles, ledger lookups, and polling with a deadline."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import NullPool

from engine.models.extension import kernel_dir
from tenants.admin import create_key, create_tenant
from tenants.db import create_engine
from tenants.models import shed_events, usage_events
from tenants.records import Quotas

T = TypeVar("T")
READY_DEADLINE_S = 120.0
_QUOTA_FIELDS = ("cost_per_minute", "max_concurrency", "monthly_budget", "max_output_tokens")


def run_db(url: str, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Run ``func(db, *args, **kwargs)`` on a fresh database connection and wait for it (on a thread of its
    own, so that it also works from a test whose event loop is running)."""

    async def main() -> T:
        db = create_engine(url, poolclass=NullPool)
        try:
            return await func(db, *args, **kwargs)
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


def wait_until(condition: Callable[[], T], deadline_s: float = 15.0, what: str = "condition") -> T:
    """Poll ``condition`` until it returns something truthy; fail after ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class ApiServer:
    base_url: str
    admin_token: str
    database_url: str
    process: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    async def create_tenant(self, db: AsyncEngine, **options: Any) -> tuple[int, str]:
        quota = Quotas(**{k: options.pop(k) for k in _QUOTA_FIELDS if k in options})
        tenant = await create_tenant(db, f"t-{uuid.uuid4().hex[:10]}", quota=quota, **options)
        _, secret = await create_key(db, tenant.id)
        return tenant.id, secret

    def admin(self, path: str) -> dict:
        response = httpx.get(
            f"{self.base_url}/admin/api/{path}",
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=10,
        )
        response.raise_for_status()
        return response.json()

    def engine_idle(self) -> dict | None:
        """The engine's stats once nothing runs or waits and every KV block is free, else None."""
        stats = self.admin("engine")
        idle = stats["running"] == 0 and stats["waiting"] == 0
        return stats if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"] else None

    def usage_rows(self, tenant_id: int) -> list[dict]:
        return self._usage(usage_events.c.tenant_id == tenant_id)

    def _usage(self, where: sa.ColumnElement[bool]) -> list[dict]:
        async def query(db: AsyncEngine) -> list[dict]:
            async with db.connect() as conn:
                rows = await conn.execute(sa.select(usage_events).where(where))
                return [dict(row._mapping) for row in rows]

        return run_db(self.database_url, query)

    def shed_reasons(self, tenant_id: int) -> list[str]:
        async def query(db: AsyncEngine) -> list[str]:
            async with db.connect() as conn:
                rows = await conn.execute(
                    sa.select(shed_events.c.reason).where(shed_events.c.tenant_id == tenant_id)
                )
                return [row.reason for row in rows]

        return run_db(self.database_url, query)

    def wait_usage_row(self, request_id: str, deadline_s: float = 15.0) -> dict:
        """The ledger row of one request, once it is written."""
        rows = wait_until(
            lambda: self._usage(usage_events.c.request_id == request_id), deadline_s, f"usage of {request_id}"
        )
        return rows[0]

    def wait_usage(self, tenant_id: int, count: int, deadline_s: float = 15.0) -> list[dict]:
        """The tenant's ledger rows once there are ``count`` of them."""
        return _wait_count(
            lambda: self.usage_rows(tenant_id), count, deadline_s, f"usage of tenant {tenant_id}"
        )

    def wait_shed_reasons(self, tenant_id: int, count: int = 1, deadline_s: float = 15.0) -> list[str]:
        """The reasons of the tenant's recorded refusals, once there are ``count`` of them."""
        return _wait_count(
            lambda: self.shed_reasons(tenant_id), count, deadline_s, f"refusals of {tenant_id}"
        )


def _wait_count(fetch: Callable[[], list[T]], count: int, deadline_s: float, what: str) -> list[T]:
    def enough() -> list[T] | None:
        items = fetch()
        return items if len(items) >= count else None

    return wait_until(enough, deadline_s, f"{count} {what}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serving(
    model_dir: Path, database_url: str, state_dir: Path, *options: str, env: dict[str, str] | None = None
) -> Iterator[ApiServer]:
    """``weir serve --model model_dir *options`` on a free port over a migrated ``database_url``, once ready,
    with ``env`` added to the environment; its output goes to ``state_dir/server.log``. Stopped on exit."""
    port = _free_port()
    admin_token = uuid.uuid4().hex
    env = {
        **os.environ,
        **(env or {}),
        "DATABASE_URL": database_url,
        "WEIR_ADMIN_TOKEN": admin_token,
        "WEIR_STATE_DIR": str(state_dir),
        "WEIR_KERNEL_DIR": str(kernel_dir().resolve()),  # one kernel build for every test server
    }
    log_path = state_dir / "server.log"
    command = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--dtype", "float32"]  # the same arithmetic whatever this machine measures fastest
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, *options],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )
    server = ApiServer(f"http://127.0.0.1:{port}", admin_token, database_url, process, log_path)
    try:
        ready = f"{server.base_url}/readyz"
        _wait_ready(process, lambda: httpx.get(ready, timeout=2), log_path, "weir serve")
        yield server
    finally:
        _stop(process)


def _wait_ready(
    process: subprocess.Popen, get: Callable[[], httpx.Response], log_path: Path, what: str
) -> None:
    """Wait until ``get()`` answers 200; fail the test when ``process`` exits or the deadline passes."""
    deadline = time.monotonic() + READY_DEADLINE_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"{what} exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if get().status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} was not ready within {READY_DEADLINE_S}s:\n{log_path.read_text()}")
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class EngineServer:
    """A running ``weir engine``; ``url`` as ``weir serve --backend`` takes it (``http://`` or ``unix:``)."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def get(self, path: str, timeout: float = 10) -> httpx.Response:
        if self.url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=self.url.removeprefix("unix:"))
            with httpx.Client(transport=transport) as client:
                return client.get(f"http://engine{path}", timeout=timeout)
        return httpx.get(f"{self.url}{path}", timeout=timeout)

    def stats(self) -> dict:
        return self.get("/stats").json()

    def idle(self) -> dict | None:
        """Its stats once nothing runs or waits and every KV block is free, else None."""
        stats = self.stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0
        return stats if idle and stats["kv_blocks_free"] == stats["kv_blocks_total"] else None

    def wait_ready(self) -> None:
        _wait_ready(self.process, lambda: self.get("/health", 2), self.log_path, "weir engine")

    def stop(self) -> None:
        _stop(self.process)


def start_engine(model_dir: Path, state_dir: Path, *options: str, unix_socket: bool = False) -> EngineServer:
    """``weir engine --model model_dir *options`` on a free port, or on the unix socket
    ``state_dir/engine.sock``, started (not yet ready); its output goes to ``state_dir/engine.log``."""
    env = {**os.environ, "WEIR_KERNEL_DIR": str(kernel_dir().resolve()), "WEIR_STATE_DIR": str(state_dir)}
    if unix_socket:
        path = state_dir / "engine.sock"
        where, url = ["--socket", str(path)], f"unix:{path}"
    else:
        port = _free_port()
        where, url = ["--port", str(port)], f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "api.cli", "engine", "--model", str(model_dir), *where]
    log_path = state_dir / "engine.log"
    with open(log_path, "a") as log:
        process = subprocess.Popen(
            [*command, "--dtype", "float32", *options],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[2],
        )
    return EngineServer(url, process, log_path)


@contextmanager
def engines_serving(
    model_dir: Path, state_dirs: list[Path], *options: str, unix_sockets: bool = False
) -> Iterator[list[EngineServer]]:
    """One ``weir engine`` per state directory (``start_engine``), started together and yielded once all
    are ready; stopped on exit."""
    engines = []
    try:
        for state_dir in state_dirs:
            engines.append(start_engine(model_dir, state_dir, *options, unix_socket=unix_sockets))
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()
