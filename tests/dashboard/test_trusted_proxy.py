"""``weir serve`` behind a TLS-terminating proxy that FORWARDED_ALLOW_IPS names: its forwarded headers count
(without that variable they do not: tests/dashboard/test_signin.py)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.api.server import serving, wait_until
from tests.dashboard.browser import fail_sign_in
from tests.dashboard.conftest import SERVE_OPTIONS
from tests.fixtures.database import copy_of_template


def test_behind_a_trusted_proxy_the_cookie_is_secure_and_the_client_address_is_forwarded(
    tiny_model_dir: Path, pg_server_url: str, migrated_template: str, tmp_path: Path
) -> None:
    """With FORWARDED_ALLOW_IPS naming a TLS-terminating proxy on this host, its X-Forwarded-Proto makes
    the cookie Secure and its X-Forwarded-For is the address sign-ins are limited by."""
    trusted = {"FORWARDED_ALLOW_IPS": "127.0.0.1"}
    with (
        copy_of_template(pg_server_url, migrated_template, prefix="weir_proxied") as url,
        serving(tiny_model_dir, url, tmp_path, *SERVE_OPTIONS, env=trusted) as server,
    ):
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            proxied = client.get("/admin/login", headers={"x-forwarded-proto": "https"})
        assert "; secure" in proxied.headers["set-cookie"].lower()
        fail_sign_in(server.base_url, {"x-forwarded-for": "203.0.113.8"})
        wait_until(
            lambda: "admin sign-in from 203.0.113.8 failed" in server.log_path.read_text(),
            what="the forwarded address in the server's log",
        )
