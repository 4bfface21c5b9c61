"""Every dashboard page through a real browser: its figures equal the ledger's, and its forms work."""

from __future__ import annotations

import csv
import html
import io
import json
import os
import random
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import httpx
import sqlalchemy as sa
from playwright.sync_api import Page

from tenants.admin import get_tenant
from tenants.models import usage_events
from tests.api.server import ApiServer, run_db, wait_until
from tests.dashboard.browser import figure, number, screenshot, signed_in_client
from tests.dashboard.conftest import HISTORY_ROWS, Traffic
from tests.dashboard.ledger import ledger_totals

CSV_HEADER = (
    "id,tenant,key_prefix,model,period_start,period_end,closed,requests,prompt_tokens,cached_tokens,"
    "output_tokens,cost_units"
)


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%S")


# The random windows' seed: drawn per run, or WEIR_WINDOWS_SEED to replay a failed run's windows.
WINDOWS_SEED = int(os.environ.get("WEIR_WINDOWS_SEED") or random.randrange(2**32))


def _windows(traffic: Traffic) -> list[tuple[datetime, datetime]]:
    """The whole traffic, and random sub-ranges of the last week (to the second, as the form takes them),
    drawn from ``WINDOWS_SEED`` (printed, so a failure's output names it)."""
    now = datetime.now(UTC).replace(microsecond=0)
    print(f"random windows from WINDOWS_SEED={WINDOWS_SEED} (replay: WEIR_WINDOWS_SEED={WINDOWS_SEED})")
    rng = random.Random(WINDOWS_SEED)
    windows = [(traffic.started.replace(microsecond=0), now + timedelta(hours=1))]
    for _ in range(2):
        since = now - timedelta(seconds=rng.randint(3600, 7 * 86400))
        windows.append((since, since + timedelta(seconds=rng.randint(600, 4 * 86400))))
    return windows


def _check_figures(page: Page, expected: dict) -> None:
    for name in ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "slo_met"):
        assert number(figure(page, name)) == expected[name], name
    assert Decimal(figure(page, "cost_units").replace(",", "")) == expected["cost_units"]
    for reason in ("rate", "concurrency", "budget", "queue", "kv", "slo", "deadline"):
        shown = number(page.inner_text(f"[data-refusal={reason}]"))
        assert shown == expected["refusals"].get(reason, 0), reason


def test_overview_figures_equal_the_ledger(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    base = dashboard_server.base_url
    for since, until in _windows(traffic):
        admin_page.goto(f"{base}/admin?range=custom&since={_iso(since)}&until={_iso(until)}")
        _check_figures(admin_page, ledger_totals(dashboard_server.database_url, since, until))
    admin_page.goto(f"{base}/admin")
    assert admin_page.get_by_text("Live engine").is_visible()
    stats = dashboard_server.admin("engine")
    used = number(admin_page.inner_text("[data-engine-figure=kv_blocks_used]"))
    assert 0 <= used <= stats["kv_blocks_total"]
    assert number(admin_page.inner_text("[data-engine-figure=running]")) == 0  # no traffic now
    screenshot(admin_page, "overview")


def test_tenants_table_equals_the_ledger_and_sorts(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    since, until = _windows(traffic)[0]
    query = f"range=custom&since={_iso(since)}&until={_iso(until)}"
    admin_page.goto(f"{dashboard_server.base_url}/admin/tenants?{query}")
    for name, tenant_id in traffic.tenant_ids.items():
        expected = ledger_totals(dashboard_server.database_url, since, until, tenant_id)
        row = admin_page.locator(f"tr[data-tenant={name}]")
        for column in ("requests", "prompt_tokens", "cached_tokens", "output_tokens"):
            assert number(row.locator(f"[data-col={column}]").inner_text()) == expected[column], (
                name,
                column,
            )
        assert (
            Decimal(row.locator("[data-col=cost_units]").inner_text().replace(",", ""))
            == expected["cost_units"]
        )
        assert number(row.locator("[data-col=refused]").inner_text()) == sum(expected["refusals"].values())
    admin_page.click("th >> text=Cost units")
    costs = [
        Decimal(c.replace(",", "")) for c in admin_page.locator("td[data-col=cost_units]").all_inner_texts()
    ]
    assert costs == sorted(costs, reverse=True) and len(costs) == len(traffic.tenant_ids)
    admin_page.click("th >> text=Cost units")
    costs = [
        Decimal(c.replace(",", "")) for c in admin_page.locator("td[data-col=cost_units]").all_inner_texts()
    ]
    assert costs == sorted(costs)
    admin_page.goto(f"{dashboard_server.base_url}/admin/tenants?range=7d&sort=requests")
    screenshot(admin_page, "tenants")


def test_tenant_detail_shows_charts_and_the_ledger_figures(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    base = dashboard_server.base_url
    tenant_id = traffic.tenant_ids["initech"]
    for since, until in _windows(traffic):
        admin_page.goto(f"{base}/admin/tenants/initech?range=custom&since={_iso(since)}&until={_iso(until)}")
        _check_figures(admin_page, ledger_totals(dashboard_server.database_url, since, until, tenant_id))
    admin_page.goto(f"{base}/admin/tenants/initech?range=7d")
    charts = admin_page.locator("svg.chart")
    assert charts.count() == 4
    assert admin_page.locator("svg[aria-label='Cost units per interval'] rect[fill]").count() > 0
    target = admin_page.locator("svg[aria-label='TTFT p50 and p99'] line[data-target]")
    assert target.get_attribute("data-target") == "1.0"  # initech's TTFT target
    assert admin_page.locator("svg[aria-label='Refusals by reason'] rect title").count() > 0
    screenshot(admin_page, "tenant")
    admin_page.goto(f"{base}/admin/tenants/nobody")
    assert "no tenant 'nobody'" in admin_page.inner_text("[role=alert]")


def _models_status(server: ApiServer, secret: str) -> int:
    headers = {"Authorization": f"Bearer {secret}"}
    return httpx.get(f"{server.v1}/models", headers=headers, timeout=10).status_code


def test_create_a_key_then_revoke_it(admin_page: Page, dashboard_server: ApiServer, traffic: Traffic) -> None:
    admin_page.goto(f"{dashboard_server.base_url}/admin/tenants/acme")
    admin_page.click("text=Create a key")
    secret = admin_page.inner_text("[data-new-secret]").strip()
    assert secret.startswith("wk-")
    screenshot(admin_page, "tenant-new-key")
    assert _models_status(dashboard_server, secret) == 200
    prefix = secret[:10]
    row = admin_page.locator("tr[data-key]", has_text=prefix)
    row.locator("text=Revoke").click()
    admin_page.wait_for_url(f"{dashboard_server.base_url}/admin/tenants/acme")
    assert secret not in admin_page.content()  # the secret was shown once
    assert (
        admin_page.locator("tr[data-key]", has_text=prefix).locator("[data-col=revoked]").inner_text() != "—"
    )
    assert admin_page.locator("tr[data-key]", has_text=prefix).locator("text=Revoke").count() == 0
    admin_page.locator("table[data-table=keys]").scroll_into_view_if_needed()
    screenshot(admin_page, "tenant-keys-settings")
    wait_until(lambda: _models_status(dashboard_server, secret) == 401, 15.0, "the revoked key's 401")
    assert _models_status(dashboard_server, traffic.secrets["acme"]) == 200  # the tenant's other key works


def test_settings_form_changes_the_tenant(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    url = dashboard_server.database_url
    admin_page.goto(f"{dashboard_server.base_url}/admin/tenants/globex")
    admin_page.fill("#setting-weight", "3.5")
    admin_page.fill("#setting-max_concurrency", "4")
    admin_page.fill("#setting-tpot_target_s", "0.15")
    admin_page.click("text=Save settings")
    admin_page.wait_for_url(f"{dashboard_server.base_url}/admin/tenants/globex")
    tenant = run_db(url, get_tenant, "globex")
    assert (tenant.weight, tenant.tpot_target_s) == (3.5, 0.15)
    assert tenant.quotas.max_concurrency == 4 and tenant.quotas.cost_per_minute == 120.0
    assert tenant.quotas.monthly_budget is None
    admin_page.fill("#setting-max_concurrency", "four")
    with admin_page.expect_response(lambda r: r.request.method == "POST") as posted:
        admin_page.click("text=Save settings")
    assert posted.value.status == 400
    assert "Concurrent requests must be a whole number, got 'four'" in admin_page.inner_text("[role=alert]")
    admin_page.fill("#setting-max_concurrency", "")
    admin_page.fill("#setting-weight", "0")
    admin_page.click("text=Save settings")
    assert "weight" in admin_page.inner_text("[role=alert]")
    assert run_db(url, get_tenant, "globex") == tenant  # nothing changed by the refused forms


async def _ledger_ids(db, tenant_id: int, status: str | None = None) -> list[str]:
    u = usage_events.c
    query = (
        sa.select(u.request_id)
        .where(u.tenant_id == tenant_id)
        .order_by(u.finished_at.desc(), u.request_id.desc())
    )
    if status:
        query = query.where(u.status == status)
    async with db.connect() as conn:
        return list((await conn.execute(query)).scalars())


def test_requests_are_paged_newest_first_and_filtered(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    url, base = dashboard_server.database_url, dashboard_server.base_url
    tenant_id = traffic.tenant_ids["initech"]
    admin_page.goto(f"{base}/admin/requests?tenant=initech")
    seen: list[str] = []
    pages = 0
    while True:
        pages += 1
        seen += admin_page.locator("tr[data-request]").evaluate_all(
            "rows => rows.map(r => r.dataset.request)"
        )
        older = admin_page.locator("a[rel=next]")
        if older.count() == 0:
            break
        older.click()
    assert seen == run_db(url, _ledger_ids, tenant_id)
    assert len(seen) == HISTORY_ROWS and pages == 3
    errors = run_db(url, _ledger_ids, tenant_id, "error")
    admin_page.goto(f"{base}/admin/requests?tenant=initech&status=error")
    assert (
        admin_page.locator("tr[data-request]").evaluate_all("rows => rows.map(r => r.dataset.request)")
        == errors
    )
    admin_page.goto(f"{base}/admin/requests")
    screenshot(admin_page, "requests")
    admin_page.locator("tr[data-request] a").first.click()
    request_id = admin_page.url.rsplit("/", 1)[1]
    row = dashboard_server.wait_usage_row(request_id)
    for name in ("prompt_tokens", "cached_tokens", "output_tokens"):
        assert number(admin_page.inner_text(f"[data-field={name}]")) == row[name]
    assert Decimal(admin_page.inner_text("[data-field=cost_units]").replace(",", "")) == row["cost"]
    screenshot(admin_page, "request")


def _download(page: Page, button: str) -> str:
    with page.expect_download() as download:
        page.click(f"button[data-format='{button}']")
    return open(download.value.path(), encoding="utf-8").read()


def test_exports_download_what_the_ledger_holds(
    admin_page: Page, dashboard_server: ApiServer, traffic: Traffic
) -> None:
    admin_page.goto(f"{dashboard_server.base_url}/admin/exports")
    screenshot(admin_page, "exports")
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    since, until = today - timedelta(days=8), today + timedelta(days=1)
    admin_page.fill("#since", since.date().isoformat())
    admin_page.fill("#until", until.date().isoformat())
    text = _download(admin_page, "usage.csv")
    assert text.splitlines()[0] == CSV_HEADER
    rows = list(csv.DictReader(io.StringIO(text)))
    expected = ledger_totals(dashboard_server.database_url, since, until)
    for column in ("requests", "prompt_tokens", "cached_tokens", "output_tokens"):
        assert sum(int(r[column]) for r in rows) == expected[column], column
    assert sum(Decimal(r["cost_units"]) for r in rows) == expected["cost_units"]
    lines = _download(admin_page, "usage.jsonl").splitlines()
    assert [json.loads(line)["id"] for line in lines] == [r["id"] for r in rows]
    focus = _download(admin_page, "usage.focus.csv")
    assert "BilledCost" in focus.splitlines()[0]
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        one = client.get(f"/admin/exports/usage.csv?since={since.date()}&until={until.date()}&tenant=initech")
        assert one.status_code == 200 and one.headers["content-type"].startswith("text/csv")
        assert {r["tenant"] for r in csv.DictReader(io.StringIO(one.text))} == {"initech"}
        dates = {"since": since.date().isoformat(), "until": until.date().isoformat()}
        bad = [
            ({"granularity": "week"}, "granularity must be one of request, hour, day"),
            ({"since": "2026-01-01T05:00"}, "since must be on a whole day"),
            ({"until": ""}, "An export needs since and until"),
            ({"since": "yesterday"}, "since must be an ISO date"),
            ({"tenant": "nobody"}, "no tenant 'nobody'"),
        ]
        for change, message in bad:
            response = client.get("/admin/exports/usage.csv", params={**dates, **change})
            assert response.status_code in (400, 404), change
            assert message in html.unescape(response.text), change
        assert client.get("/admin/exports/usage.xml?since=2026-01-01&until=2026-01-02").status_code == 404


def test_a_bad_range_is_a_clear_error(admin_page: Page, dashboard_server: ApiServer) -> None:
    base = dashboard_server.base_url
    cases = {
        "/admin?range=2d": "range must be one of 1h, 24h, 7d, 30d, custom",
        "/admin/tenants?range=custom": "a custom range needs since",
        "/admin/tenants/acme?since=May": "since must be an ISO date",
        "/admin?since=2026-05-02&until=2026-05-01": "must be after since",
        "/admin/tenants?sort=mood": "sort must be one of",
        "/admin/requests?key=abc": "key must be a key id",
        "/admin/requests?before=garbage": "not a ledger page cursor",
    }
    for path, message in cases.items():
        response = admin_page.goto(f"{base}{path}")
        assert response is not None and response.status == 400, path
        assert message in admin_page.inner_text("[role=alert]"), path


def test_a_custom_range_is_bounded_to_500_chart_points(dashboard_server: ApiServer, traffic: Traffic) -> None:
    """The longest custom range charts 500 UTC days; one day more, or a date out of 2000-2100 (year 1 to
    9999 included), is a 400 that says why, before any figure is read."""
    today = datetime.now(UTC).date()
    longest = f"since={today - timedelta(days=499)}&until={today + timedelta(days=1)}"
    refused = {
        f"since={today - timedelta(days=500)}&until={today + timedelta(days=1)}": "covers 501",
        "since=0001-01-01&until=9999-12-31": "since must be from 2000-01-01 to 2100-01-01",
        "since=2000-01-01&until=2100-01-01": "at most 500 UTC days",
        "since=0001-01-01T00:00%2B01:00&until=2026-01-01": "since must be from 2000-01-01",
    }
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        page = client.get(f"/admin/tenants/initech?range=custom&{longest}")
        assert page.status_code == 200
        intervals = [int(n) for n in re.findall(r'class="chart" data-intervals="(\d+)"', page.text)]
        assert intervals == [500] * 4
        for query, message in refused.items():
            for path in ("/admin", "/admin/tenants", "/admin/tenants/initech"):
                response = client.get(f"{path}?range=custom&{query}")
                assert response.status_code == 400, (path, query)
                assert message in html.unescape(response.text), (path, query)


def test_the_download_name_holds_the_parsed_dates(dashboard_server: ApiServer, traffic: Traffic) -> None:
    """Whatever ISO spelling since and until have (a week date, a space, an offset), the file is named
    by the UTC moments they stand for."""
    query = {"since": "2026-W01-1", "until": "2026-01-02 01:00+01:00", "granularity": "hour"}
    with signed_in_client(dashboard_server.base_url, dashboard_server.admin_token) as client:
        response = client.get("/admin/exports/usage.jsonl", params=query)
    assert response.status_code == 200
    name = "weir-usage-hour-2025-12-29-2026-01-02.jsonl"
    assert response.headers["content-disposition"] == f'attachment; filename="{name}"'
