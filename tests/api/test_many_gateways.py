"""Two ``weir serve`` gateways on one database in front of the same two ``weir engine`` processes: one tenant
sends concurrent requests through both until its quota refuses them (429 in OpenAI's error format); the
cost it was admitted stays within the documented bound for several processes (docs/architecture.md, "One
process, several processes"), every admitted request has one ledger row, both gateways served, and the
admin JSON and the dashboard's tenants table of each gateway show the ledger's totals."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import openai
import pytest

from tests.api import test_pool as pool_tests
from tests.api.server import ApiServer, EngineServer, run_db, serving
from tests.api.test_fair_share import _model, _prompt
from tests.api.test_output_allowance import _assert_quota_returns
from tests.dashboard.browser import signed_in_client
from tests.dashboard.ledger import ledger_totals
from tests.fixtures.database import copy_of_template

PROMPT_TOKENS = 16
MAX_TOKENS = 8
WORST_CASE = PROMPT_TOKENS + 2 * MAX_TOKENS  # what each request reserves, and is charged (no early stop)
LIMIT = 6.5 * WORST_CASE  # a few requests' worth, in cost units
PER_WAVE = 4  # concurrent requests per gateway in each wave, every other one streamed
WAVES_DEADLINE_S = 120.0
# The limit, the refusal's code and reason, and whether the limit refills (at limit / 60 per second).
LIMITS = {
    "monthly_budget": ("insufficient_quota", "budget", False),
    "cost_per_minute": ("rate_limit_exceeded", "rate", True),
}


engines = pool_tests.engines  # two `weir engine`s (max two sequences each), started for this module


@dataclass(frozen=True)
class Outcome:
    """One request's answer: the ledger id it was admitted under, or the code it was refused with."""

    gateway: int
    request_id: str | None
    refusal: str | None


@pytest.fixture(scope="module")
def gateways(
    engines: list[EngineServer],
    tiny_model_dir: Path,
    pg_server_url: str,
    migrated_template: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[ApiServer]]:
    """Two ``weir serve`` processes, each with both engines as ``--backend``, on one database."""
    options = [arg for engine in engines for arg in ("--backend", engine.url)] + ["--log-level", "warning"]
    with ExitStack() as stack:
        url = stack.enter_context(copy_of_template(pg_server_url, migrated_template, prefix="weir_gateways"))
        yield [
            stack.enter_context(
                serving(tiny_model_dir, url, tmp_path_factory.mktemp(f"gateway-{i}"), *options)
            )
            for i in range(2)
        ]


async def _request(gateway: int, client: openai.AsyncOpenAI, model: str, seed: int, stream: bool) -> Outcome:
    """One completion, streamed (with its usage) or not; a refusal must be a 429 in OpenAI's error format."""
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    try:
        answer = await client.completions.create(
            model=model, prompt=_prompt(seed, PROMPT_TOKENS), max_tokens=MAX_TOKENS, temperature=0, **options
        )
        chunks = [chunk async for chunk in answer] if stream else [answer]
    except openai.RateLimitError as refused:
        error = refused.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        return Outcome(gateway, None, error["code"])
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    return Outcome(gateway, chunks[0].id, None)


async def _until_a_wave_is_refused(clients: list[openai.AsyncOpenAI], model: str, seed: int) -> list[Outcome]:
    """Waves of concurrent requests through every gateway until one wave is refused whole (or far more than
    the limit was admitted: the test then fails on the bound, not on a deadline)."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + WAVES_DEADLINE_S
    while (admitted := sum(bool(o.request_id) for o in outcomes)) * WORST_CASE <= 2 * LIMIT:
        assert time.monotonic() < deadline, f"no wave refused whole: {admitted} of {len(outcomes)} admitted"
        wave = [
            _request(g, client, model, seed + len(outcomes) + g * PER_WAVE + i, stream=i % 2 == 1)
            for g, client in enumerate(clients)
            for i in range(PER_WAVE)
        ]
        answers = await asyncio.gather(*wave)
        outcomes += answers
        if all(o.refusal for o in answers):
            break
    return outcomes


_ROW = re.compile(r'<tr data-tenant="([^"]+)">(.*?)</tr>', re.S)
_CELL = re.compile(r'data-col="([a-z_]+)"[^>]*>([^<]*)<')


def _dashboard_row(gateway: ApiServer, name: str, since: datetime, until: datetime) -> dict[str, str]:
    """The tenant's figures in the dashboard's tenants table for ``[since, until)`` (by column, without
    thousands separators), read signed in as an admin."""
    window = {"range": "custom", "since": since.isoformat(), "until": until.isoformat()}
    with signed_in_client(gateway.base_url, gateway.admin_token) as client:
        page = client.get("/admin/tenants", params=window)
    assert page.status_code == 200, page.text
    rows = {tenant: cells for tenant, cells in _ROW.findall(page.text)}
    return {col: text.strip().replace(",", "") for col, text in _CELL.findall(rows[name])}


@pytest.mark.parametrize("limit", list(LIMITS))
async def test_one_tenant_at_its_limit_through_two_gateways(
    gateways: list[ApiServer], engines: list[EngineServer], limit: str
) -> None:
    code, reason, refills = LIMITS[limit]
    first = gateways[0]
    model = _model(first)
    steps = [engine.stats()["steps"] for engine in engines]
    started, began = datetime.now(UTC), time.monotonic()
    tenant_id, key = run_db(
        first.database_url, first.create_tenant, ttft_target_s=pool_tests.PATIENT_S, **{limit: LIMIT}
    )
    clients = [openai.AsyncOpenAI(base_url=g.v1, api_key=key, max_retries=0, timeout=300) for g in gateways]
    outcomes = await _until_a_wave_is_refused(clients, model, seed=1000 * (1 + list(LIMITS).index(limit)))
    elapsed = time.monotonic() - began
    admitted = [o for o in outcomes if o.request_id]
    refused = [o for o in outcomes if o.refusal]
    assert {o.refusal for o in refused} == {code}
    assert {o.gateway for o in admitted} == {0, 1}, outcomes  # both gateways served
    assert all(a > b for a, b in zip((e.stats()["steps"] for e in engines), steps, strict=True))

    rows = first.wait_usage(tenant_id, len(admitted))
    assert sorted(r["request_id"] for r in rows) == sorted(o.request_id for o in admitted)  # one row each
    assert {(r["status"], r["cost"]) for r in rows} == {("ok", WORST_CASE)}
    spent = sum(r["cost"] for r in rows)
    # The documented bound: nothing beyond the limit, plus what a per-minute bucket refilled meanwhile.
    bound = LIMIT * (1 + elapsed / 60) if refills else LIMIT
    assert spent <= bound, (spent, bound, elapsed)
    # At its limit: in the last wave each gateway was refused while its own free slice and the row's free
    # part fell short of a request, so less than a request per gateway is left unspent.
    assert spent > LIMIT - len(gateways) * WORST_CASE
    assert first.wait_shed_reasons(tenant_id, len(refused)) == [reason] * len(refused)
    _assert_quota_returns(first, tenant_id)  # every slice given back: the quota's spend is the ledger's
    assert len(first.usage_rows(tenant_id)) == len(rows)  # and no row came late

    # Whole UTC hours, so that the dashboard reads its hourly rollups, written by both gateways' ledgers.
    since = started.replace(minute=0, second=0, microsecond=0)
    until = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    expected = ledger_totals(first.database_url, since, until, tenant_id)
    assert (expected["requests"], expected["cost_units"]) == (len(rows), spent)
    for gateway in gateways:
        (tenant,) = [t for t in gateway.admin("tenants")["tenants"] if t["id"] == tenant_id]
        month = tenant["month"]
        assert Decimal(month["cost"]) == spent and month["requests"] == len(rows) and month["errors"] == 0
        assert month["output_tokens"] == expected["output_tokens"]
        assert month["prompt_tokens"] == expected["prompt_tokens"]
        assert tenant["refused"] == {reason: len(refused)}
        shown = _dashboard_row(gateway, tenant["name"], since, until)
        for column in ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "cost_units"):
            assert Decimal(shown[column]) == expected[column], (column, shown, expected)
        assert int(shown["refused"]) == len(refused)
