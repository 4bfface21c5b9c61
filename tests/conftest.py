"""Shared fixtures: a real PostgreSQL and real model weights (see tests/fixtures/)."""

pytest_plugins = ["tests.fixtures.database", "tests.fixtures.models"]
