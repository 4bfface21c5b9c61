"""A real ``weir serve`` process (tiny model, fresh migrated database) and helpers to drive and inspect it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.server import ApiServer, run_db
from tests.fixtures.database import copy_of_template

CLIENT_TIMEOUT_S = 3.0
READY_DEADLINE_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def api_database_url(pg_server_url: str, migrated_template: str) -> Iterator[str]:
    """One migrated database for the API suite's server (tests use their own tenants in it)."""
    with copy_of_template(pg_server_url, migrated_template, prefix="weir_api") as url:
        yield url


@pytest.fixture(scope="session")
def api_server(
    tiny_model_dir: Path, api_database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    """``weir serve`` on a free port with the tiny model and a short client timeout."""
    state = tmp_path_factory.mktemp("api-state")
    port = _free_port()
    admin_token = uuid.uuid4().hex
    env = {
        **os.environ,
        "DATABASE_URL": api_database_url,
        "WEIR_ADMIN_TOKEN": admin_token,
        "WEIR_STATE_DIR": str(state),
    }
    log_path = state / "server.log"
    command = [
        sys.executable,
        "-m",
        "api.cli",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--client-timeout",
        str(CLIENT_TIMEOUT_S),
        "--kv-cache-memory",
        "8",
        "--log-level",
        "warning",
    ]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2]
        )
    server = ApiServer(f"http://127.0.0.1:{port}", admin_token, api_database_url, process, log_path)
    try:
        deadline = time.monotonic() + READY_DEADLINE_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"weir serve exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(f"{server.base_url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"weir serve was not ready within {READY_DEADLINE_S}s:\n{log_path.read_text()}")
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def make_tenant(api_server: ApiServer):
    """``make_tenant(**quota_or_targets) -> (tenant_id, api_key)``: a fresh tenant with one key."""

    def make(**options) -> tuple[int, str]:
        return run_db(api_server.database_url, api_server.create_tenant, **options)

    return make
