"""Shared fixtures: a real PostgreSQL, real model weights and the API suite's server (see tests/fixtures/)."""

pytest_plugins = ["tests.fixtures.database", "tests.fixtures.models", "tests.fixtures.api_server"]
