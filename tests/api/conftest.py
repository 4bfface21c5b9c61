"""Fixtures of the API tests alone (the API suite's ``weir serve``, which tests/bench drives too, is the
session's one in tests/fixtures/api_server.py)."""

from tests.fixtures.api_server import CLIENT_TIMEOUT_S  # noqa: F401 (the API tests import it from here)
