"""Signing in to the dashboard: the admin token only, sessions, CSRF on every form, failures limited."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Browser

from dashboard.sessions import MAX_ADDRESSES, SignInLimiter
from tests.api.server import ApiServer, wait_until
from tests.dashboard.browser import (
    VIEWPORT,
    csrf_token,
    fail_sign_in,
    screenshot,
    sign_in,
    signed_in_client,
)
from tests.dashboard.conftest import Traffic


def test_sign_in_and_out_in_the_browser(browser: Browser, dashboard_server: ApiServer) -> None:
    base = dashboard_server.base_url
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(f"{base}/admin/tenants")
    assert page.url == f"{base}/admin/login?next=/admin/tenants"
    screenshot(page, "login")
    cookie = next(c for c in context.cookies() if c["name"] == "weir_admin_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/admin"
    page.fill("input[name=token]", dashboard_server.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/admin/tenants")
    signed_in = next(c for c in context.cookies() if c["name"] == "weir_admin_session")
    assert signed_in["value"] != cookie["value"]  # a new session id once signed in
    page.click("text=Sign out")
    page.wait_for_url(f"{base}/admin/login")
    page.goto(f"{base}/admin")
    assert page.url.startswith(f"{base}/admin/login")
    context.close()


def test_pages_and_forms_are_refused_without_a_session(dashboard_server: ApiServer, traffic: Traffic) -> None:
    with httpx.Client(base_url=dashboard_server.base_url, timeout=30) as client:
        for path in ("/admin", "/admin/tenants", "/admin/tenants/acme", "/admin/requests", "/admin/exports"):
            response = client.get(path)
            assert response.status_code == 303, path
            assert response.headers["location"].startswith("/admin/login?next=")
        download = client.get("/admin/exports/usage.csv?since=2026-01-01&until=2026-02-01")
        assert download.status_code == 303
        form = client.get("/admin/login")
        refused = client.post("/admin/tenants/acme/keys", data={"_csrf_token": csrf_token(form.text)})
        assert refused.status_code == 403
        assert "Sign in first" in refused.text


def _tenant_page(server: ApiServer, tenant: str) -> str:
    with signed_in_client(server.base_url, server.admin_token) as client:
        return client.get(f"/admin/tenants/{tenant}").text


def test_a_form_with_a_bad_csrf_token_is_refused(dashboard_server: ApiServer, traffic: Traffic) -> None:
    before = _tenant_page(dashboard_server, "acme").count("data-key=")
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        for data in ({"_csrf_token": "not-the-token"}, {}):
            response = client.post("/admin/tenants/acme/keys", data=data)
            assert response.status_code == 403
            assert "security token is missing or out of date" in response.text
        settings = client.post("/admin/tenants/acme/settings", data={"weight": "9", "_csrf_token": "x"})
        assert settings.status_code == 403
        signed_out = client.post("/admin/logout", data={"_csrf_token": "x"})
        assert signed_out.status_code == 403
        assert client.get("/admin").status_code == 200  # still signed in
    after = _tenant_page(dashboard_server, "acme")
    assert after.count("data-key=") == before
    assert "weight 2.0" in after


def test_a_tenant_api_key_cannot_sign_in(
    browser: Browser, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    page.goto(f"{dashboard_server.base_url}/admin/login")
    page.fill("input[name=token]", traffic.secrets["acme"])
    with page.expect_response(lambda r: r.request.method == "POST") as posted:
        page.click("button[type=submit]")
    assert posted.value.status == 401
    assert "only the admin token signs in" in page.inner_text("[role=alert]")
    page.goto(f"{dashboard_server.base_url}/admin")
    assert "/admin/login" in page.url
    context.close()
    log = dashboard_server.log_path.read_text()
    assert "admin sign-in from 127.0.0.1 failed: That is a tenant's API key" in log


def test_failed_sign_ins_are_limited_and_logged(dashboard_server: ApiServer) -> None:
    """Five failures from one address, then even the right token is refused there for a while; other
    addresses still sign in."""
    transport = httpx.HTTPTransport(local_address="127.0.0.7")
    with httpx.Client(base_url=dashboard_server.base_url, transport=transport, timeout=30) as client:
        token = csrf_token(client.get("/admin/login").text)
        for attempt in range(5):
            wrong = client.post("/admin/login", data={"token": f"guess-{attempt}", "_csrf_token": token})
            assert wrong.status_code == 401
            assert "not the admin token" in wrong.text
        right = {"token": dashboard_server.admin_token, "_csrf_token": token}
        limited = client.post("/admin/login", data=right)
        assert limited.status_code == 429
        assert 0 < int(limited.headers["retry-after"]) <= 300
        assert "Too many failed sign-ins" in limited.text
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as other:
        assert other.get("/admin").status_code == 200
    wait_until(
        lambda: (
            "admin sign-in from 127.0.0.7 refused: too many failed attempts"
            in dashboard_server.log_path.read_text()
        ),
        what="the refusal in the server's log",
    )
    assert dashboard_server.log_path.read_text().count("admin sign-in from 127.0.0.7 failed") == 5


def test_api_routes_keep_bearer_auth(dashboard_server: ApiServer) -> None:
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        assert client.get("/admin/api/engine").status_code == 401  # a session is not a bearer token
    assert dashboard_server.admin("engine")["kv_blocks_total"] > 0


def test_sign_in_page_redirects_a_signed_in_admin(browser: Browser, dashboard_server: ApiServer) -> None:
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    sign_in(page, dashboard_server.base_url, dashboard_server.admin_token)
    page.goto(f"{dashboard_server.base_url}/admin/login?next=https://elsewhere.example/")
    assert page.url == f"{dashboard_server.base_url}/admin"
    context.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _addresses(count: int) -> list[str]:
    return [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(count)]


def test_failures_are_counted_after_more_than_ten_thousand_addresses_failed() -> None:
    """Once the failures of more than ``MAX_ADDRESSES`` addresses have left the window, the next failure
    is counted (no error) and the address is refused after its fifth."""
    clock = Clock()
    limiter = SignInLimiter(attempts=5, window_s=300.0, clock=clock)
    for address in _addresses(MAX_ADDRESSES + 1):
        limiter.failed(address)
    clock.now = 301.0
    for _ in range(5):
        assert limiter.retry_after_s("203.0.113.9") == 0
        limiter.failed("203.0.113.9")
    assert limiter.retry_after_s("203.0.113.9") == 300.0


def test_the_limiter_keeps_at_most_ten_thousand_addresses() -> None:
    """Beyond ``MAX_ADDRESSES`` addresses with failures in the window, the one whose latest failure is
    oldest is forgotten first; the others stay refused."""
    clock = Clock()
    limiter = SignInLimiter(attempts=5, window_s=300.0, clock=clock)
    for address in ("198.51.100.1", "198.51.100.2"):
        for _ in range(5):
            limiter.failed(address)
        clock.now += 1.0
    for address in _addresses(MAX_ADDRESSES - 1):
        limiter.failed(address)
    assert limiter.retry_after_s("198.51.100.1") == 0
    assert limiter.retry_after_s("198.51.100.2") == 299.0
    limiter.failed("198.51.100.3")
    assert limiter.retry_after_s("198.51.100.2") == 0


def test_x_forwarded_headers_are_ignored_by_default(dashboard_server: ApiServer) -> None:
    """Without FORWARDED_ALLOW_IPS no proxy is trusted, not even on loopback: a failed sign-in counts
    against the connection's address whatever X-Forwarded-For says, and X-Forwarded-Proto makes no
    cookie Secure."""
    before = dashboard_server.log_path.read_text().count("admin sign-in from 127.0.0.1 failed")
    fail_sign_in(dashboard_server.base_url, {"x-forwarded-for": "203.0.113.7"})
    wait_until(
        lambda: dashboard_server.log_path.read_text().count("admin sign-in from 127.0.0.1 failed") > before,
        what="the failure in the server's log",
    )
    assert "203.0.113.7" not in dashboard_server.log_path.read_text()
    with httpx.Client(base_url=dashboard_server.base_url, timeout=30) as client:
        plain = client.get("/admin/login").headers["set-cookie"]
        proxied = client.get("/admin/login", headers={"x-forwarded-proto": "https"}).headers["set-cookie"]
    for cookie in (plain, proxied):
        attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
        assert {"httponly", "path", "samesite"} <= attributes
        assert "samesite=strict" in cookie.lower()
        assert "secure" not in cookie.lower()


@pytest.mark.parametrize("path", ["/admin/login", "/admin/tenants/nobody"])
def test_pages_may_not_be_framed(dashboard_server: ApiServer, path: str) -> None:
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        response = client.get(path, follow_redirects=True)
    assert response.status_code in (200, 404)
    assert response.headers["content-security-policy"] == "frame-ancestors 'none'"
    assert response.headers["x-frame-options"] == "DENY"
