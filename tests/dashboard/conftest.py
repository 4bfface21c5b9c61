"""A real ``weir serve`` with a few tenants' traffic (real requests, refusals, and a week of older ledger
rows), and a headless Chromium signed in to its dashboard."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from playwright.sync_api import Browser, Page, sync_playwright
from sqlalchemy.ext.asyncio import AsyncEngine

from engine.cost import DEFAULT_WEIGHTS
from tenants.admin import create_key, create_tenant
from tenants.models import SHED_REASONS, shed_events, usage_events
from tenants.records import Quotas
from tests.api.server import ApiServer, run_db, serving
from tests.dashboard.browser import VIEWPORT, launch, sign_in
from tests.fixtures.database import copy_of_template

HISTORY_ROWS = 120  # older ledger rows of the "initech" tenant, over the last week
SEED = 20261203
SERVE_OPTIONS = ("--model-name", "tiny-llama", "--kv-cache-memory", "8", "--log-level", "info")


@pytest.fixture(scope="session")
def dashboard_server(
    tiny_model_dir: Path, pg_server_url: str, migrated_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    with copy_of_template(pg_server_url, migrated_template, prefix="weir_dash") as url:
        state = tmp_path_factory.mktemp("dashboard-state")
        with serving(tiny_model_dir, url, state, *SERVE_OPTIONS) as server:
            yield server


@dataclass(frozen=True)
class Traffic:
    """The tenants the dashboard shows: names to ids, one working key each, and the requests made."""

    tenant_ids: dict[str, int]
    secrets: dict[str, str]
    started: datetime  # before the first ledger row
    served: dict[str, int]  # requests answered 200 per tenant


def _cost(prompt: int, cached: int, output: int) -> Decimal:
    w = DEFAULT_WEIGHTS
    value = w.prefill * (prompt - cached) + w.cached * cached + w.decode * output
    return Decimal(str(value)).quantize(Decimal("0.000001"))


async def _make_tenants(db: AsyncEngine) -> tuple[dict[str, int], dict[str, str]]:
    ids, secrets = {}, {}
    options = {
        "acme": {"weight": 2.0, "quota": Quotas(max_concurrency=8, monthly_budget=1_000_000.0)},
        "globex": {"quota": Quotas(cost_per_minute=120.0)},
        "initech": {"ttft_target_s": 1.0, "tpot_target_s": 0.1},
    }
    for name, values in options.items():
        tenant = await create_tenant(db, name, **values)
        ids[name] = tenant.id
        _, secrets[name] = await create_key(db, tenant.id)
    return ids, secrets


async def _insert_history(db: AsyncEngine, tenant_id: int, now: datetime) -> None:
    """A week of older requests and refusals for one tenant, as the API would have recorded them."""
    key, _ = await create_key(db, tenant_id)
    rng = random.Random(SEED)
    rows, refusals = [], []
    for i in range(HISTORY_ROWS):
        finished = now - timedelta(
            seconds=rng.randint(600, 7 * 86400 - 600), microseconds=rng.randint(0, 999999)
        )
        prompt, output = rng.randint(20, 900), rng.randint(1, 300)
        cached = rng.choice([0, 0, 16, 32]) if prompt > 40 else 0
        ttft, tpot = rng.uniform(0.05, 2.0), rng.uniform(0.01, 0.2)
        e2e = ttft + tpot * output
        rows.append(
            {
                "request_id": f"chatcmpl-history-{i:04d}",
                "tenant_id": tenant_id,
                "key_id": key.id,
                "model": "tiny-llama",
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "output_tokens": output,
                "cost": _cost(prompt, cached, output),
                "status": rng.choice(["ok"] * 8 + ["cancelled", "error"]),
                "finish_reason": rng.choice(["stop", "length"]),
                "queue_s": rng.uniform(0, 0.5),
                "ttft_s": ttft,
                "tpot_s": tpot,
                "e2e_s": e2e,
                "started_at": finished - timedelta(seconds=e2e),
                "finished_at": finished,
            }
        )
        if i % 3 == 0:
            at = now - timedelta(seconds=rng.randint(600, 7 * 86400 - 600))
            refusals.append(
                {
                    "event_id": uuid.uuid4().hex,
                    "tenant_id": tenant_id,
                    "reason": SHED_REASONS[i % 7],
                    "at": at,
                }
            )
    async with db.begin() as conn:
        await conn.execute(sa.insert(usage_events), rows)
        await conn.execute(sa.insert(shed_events), refusals)


def _chat(server: ApiServer, secret: str, text: str) -> httpx.Response:
    return httpx.post(
        f"{server.v1}/chat/completions",
        headers={"Authorization": f"Bearer {secret}"},
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 8},
        timeout=60,
    )


@pytest.fixture(scope="session")
def traffic(dashboard_server: ApiServer) -> Traffic:
    server = dashboard_server
    started = datetime.now(UTC) - timedelta(days=8)
    ids, secrets = run_db(server.database_url, _make_tenants)
    run_db(server.database_url, _insert_history, ids["initech"], datetime.now(UTC))
    served = {}
    for name, count in (("acme", 6), ("globex", 5)):
        codes = [
            _chat(server, secrets[name], f"hello number {i} from {name}").status_code for i in range(count)
        ]
        assert set(codes) <= {200, 429}, codes
        served[name] = codes.count(200)
        server.wait_usage(ids[name], served[name])
    assert served["acme"] == 6
    assert 0 < served["globex"] < 5  # its per-minute cost limit refuses some
    server.wait_shed_reasons(ids["globex"], 5 - served["globex"])
    return Traffic(ids, secrets, started, served)


@pytest.fixture(scope="module")
def browser(dashboard_server: ApiServer) -> Iterator[Browser]:
    """Chromium for one test module. Playwright's sync API runs an event loop on this thread while it is
    open, so it starts after the server's database (set up with ``asyncio.run``) and stops with the module,
    before other modules' asyncio tests."""
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


@pytest.fixture
def admin_page(browser: Browser, dashboard_server: ApiServer) -> Iterator[Page]:
    """A fresh browser context (1280x800), signed in to the dashboard."""
    context = browser.new_context(viewport=VIEWPORT)
    page = context.new_page()
    sign_in(page, dashboard_server.base_url, dashboard_server.admin_token)
    yield page
    context.close()
