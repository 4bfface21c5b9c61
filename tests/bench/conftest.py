"""The serve benchmark's load generator is tested against a real ``weir serve`` (the API suite's fixtures)."""

from tests.api.conftest import api_database_url, api_server, make_tenant  # noqa: F401
