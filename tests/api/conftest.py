"""Fixtures of the API tests alone (the API suite's ``weir serve``, which tests/bench drives too, is the
session's one in tests/fixtures/api_server.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tenants.db import EmbeddedPostgres, upgrade_to_head
from tests.api.server import ApiServer, serving
from tests.fixtures.api_server import CLIENT_TIMEOUT_S  # noqa: F401 (the API tests import it from here)
from tests.fixtures.database import embedded_test_server

ADMISSION_MAX_WAITING = 4  # the admission server's --max-waiting


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
