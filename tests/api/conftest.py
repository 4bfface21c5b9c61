"""A real ``weir serve`` process (tiny model, fresh migrated database) and helpers to drive and inspect it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tenants.db import EmbeddedPostgres, upgrade_to_head
from tests.api.server import ApiServer, run_db, serving
from tests.fixtures.database import copy_of_template, embedded_test_server

CLIENT_TIMEOUT_S = 3.0
ADMISSION_MAX_WAITING = 4  # the admission server's --max-waiting


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
    options = ["--client-timeout", str(CLIENT_TIMEOUT_S), "--kv-cache-memory", "8", "--log-level", "warning"]
    with serving(tiny_model_dir, api_database_url, tmp_path_factory.mktemp("api-state"), *options) as server:
        yield server


@pytest.fixture(scope="session")
def admission_postgres() -> Iterator[tuple[EmbeddedPostgres, str]]:
    """A migrated PostgreSQL of the admission server's own, which its tests may stop and start again."""
    with embedded_test_server() as (postgres, url):
        upgrade_to_head(url)
        yield postgres, url


@pytest.fixture(scope="session")
def admission_server(
    tiny_model_dir: Path,
    admission_postgres: tuple[EmbeddedPostgres, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    """``weir serve`` where admission's bounds are quickly reached: the fair policy, one running sequence,
    ``ADMISSION_MAX_WAITING`` places in the queue and a KV cache of one context window (1 MiB: 128 blocks
    of 16 tokens), over ``admission_postgres``."""
    options = [
        "--policy", "fair",
        "--max-num-seqs", "1",
        "--max-waiting", str(ADMISSION_MAX_WAITING),
        "--kv-cache-memory", "1",
        "--log-level", "warning",
    ]  # fmt: skip
    state = tmp_path_factory.mktemp("admission-state")
    with serving(tiny_model_dir, admission_postgres[1], state, *options) as server:
        yield server


@pytest.fixture
def make_tenant(api_server: ApiServer):
    """``make_tenant(**quota_or_targets) -> (tenant_id, api_key)``: a fresh tenant with one key."""

    def make(**options) -> tuple[int, str]:
        return run_db(api_server.database_url, api_server.create_tenant, **options)

    return make
