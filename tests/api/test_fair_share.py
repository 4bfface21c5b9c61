"""Fair share through the real server: backlogged tenants are served in proportion to their weights, a light
tenant is admitted and served while a heavy one floods the queue, and a queued request that cannot start
within its tenant's TTFT target (plus the grace) is refused before any byte of its answer; a request shed
under overload is refused before it is tokenized or reserved."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.server import ApiServer, run_db, serving, wait_until
from tests.fixtures.database import copy_of_template

DEADLINE_GRACE_S = 0.2
PATIENT_S = 600.0  # a TTFT target no request here misses: shedding plays no part
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def fair_server(
    tiny_model_dir: Path, pg_server_url: str, migrated_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApiServer]:
    """Two running sequences at most and small steps, so that the order of service is what decides."""
    options = [
        "--policy", "fair",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-batched-tokens", "128",
        "--kv-cache-memory", "8",
        "--deadline-grace", str(DEADLINE_GRACE_S),
        "--log-level", "warning",
    ]  # fmt: skip
    state = tmp_path_factory.mktemp("fair-state")
    with (
        copy_of_template(pg_server_url, migrated_template, prefix="weir_fair") as url,
        serving(tiny_model_dir, url, state, *options) as server,
    ):
        yield server


def _tenant(server: ApiServer, **options) -> tuple[int, openai.AsyncOpenAI]:
    tenant_id, key = run_db(server.database_url, server.create_tenant, **options)
    return tenant_id, openai.AsyncOpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=300)


def _waiting(server: ApiServer, tenant_id: int) -> int:
    """The tenant's requests waiting in the engine now."""
    return server.admin("engine")["waiting_by_tenant"].get(str(tenant_id), 0)


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _prompt(seed: int, size: int) -> list[int]:
    """Token ids that share no block with another request's (the prefix cache plays no part)."""
    return [3 + (seed * 7919 + j) % 40000 for j in range(size)]


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> int:
    answer = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return answer.usage.completion_tokens


def _served(rows: list[dict], since, until) -> float:
    """Cost units served to these requests within [since, until]: the prompt when its first token came,
    output tokens spread evenly between the first token and the end (default weights 1 and 2)."""
    total = 0.0
    for row in rows:
        first = row["started_at"] + timedelta(seconds=row["ttft_s"])
        end = row["started_at"] + timedelta(seconds=row["e2e_s"])
        if since <= first <= until:
            total += row["prompt_tokens"]
        span = (end - first).total_seconds()
        inside = (min(end, until) - max(first, since)).total_seconds()
        if span > 0 and inside > 0:
            total += 2.0 * row["output_tokens"] * inside / span
    return total


async def test_backlogged_tenants_are_served_in_the_ratio_of_their_weights(fair_server: ApiServer) -> None:
    model = _model(fair_server)
    tenants = {weight: _tenant(fair_server, weight=weight, ttft_target_s=PATIENT_S) for weight in (1.0, 2.0)}
    requests = 40
    jobs = [
        _complete(client, model, _prompt(int(weight) * 1000 + i, 16), 16)
        for i in range(requests)
        for weight, (_, client) in tenants.items()
    ]
    assert all(tokens == 16 for tokens in await asyncio.gather(*jobs))
    rows = {w: fair_server.wait_usage(tenant_id, requests) for w, (tenant_id, _) in tenants.items()}
    # The window in which both tenants had work in the engine: from the later one's first arrival to the
    # moment the first one ran out.
    since = max(min(r["started_at"] for r in rs) for rs in rows.values())
    until = min(max(r["started_at"] + timedelta(seconds=r["e2e_s"]) for r in rs) for rs in rows.values())
    assert (until - since).total_seconds() > 0
    light, heavy = (_served(rows[w], since, until) for w in (1.0, 2.0))
    assert heavy / light == pytest.approx(2.0, rel=0.15)
    wait_until(fair_server.engine_idle, what="all KV blocks free after the backlog")


async def test_a_light_tenant_is_not_shed_while_a_heavy_one_floods_the_queue(fair_server: ApiServer) -> None:
    model = _model(fair_server)
    target_s = 0.5
    heavy_id, heavy = _tenant(fair_server, ttft_target_s=PATIENT_S)
    light_id, light = _tenant(fair_server, ttft_target_s=target_s)
    flood = [asyncio.create_task(_complete(heavy, model, _prompt(5000 + i, 1900), 4)) for i in range(40)]
    await asyncio.to_thread(wait_until, lambda: fair_server.admin("engine")["waiting"] >= 30, 60.0, "a flood")
    answers, heavy_started = [], []
    for i in range(4):  # one after another, each while the flood still waits
        before = _waiting(fair_server, heavy_id)
        answers.append(await _complete(light, model, _prompt(9000 + i, 16), 4))
        heavy_started.append(before - _waiting(fair_server, heavy_id))
    assert answers == [4, 4, 4, 4]
    assert fair_server.admin("engine")["waiting"] > 0  # the flood was still queued when the last one ended
    # Each light request went ahead of the flood queued before it: while it waited and ran, no more heavy
    # requests left the queue than there are running places (first come, first served would have started
    # every one of them first).
    assert all(count <= MAX_NUM_SEQS for count in heavy_started), heavy_started
    await asyncio.gather(*flood)
    assert fair_server.shed_reasons(light_id) == []
    assert len(fair_server.wait_usage(light_id, 4)) == 4
    assert len(fair_server.wait_usage(heavy_id, 40)) == 40


async def test_a_request_shed_under_overload_is_refused_before_it_is_tokenized_or_reserved(
    fair_server: ApiServer,
) -> None:
    model = _model(fair_server)
    _, heavy = _tenant(fair_server, ttft_target_s=PATIENT_S)
    # Any work queued ahead puts this tenant past its target; its per-minute limit is below any request's
    # worst-case cost, so a reservation would be refused (429), and one token id is outside the vocabulary,
    # which tokenizing the prompt would refuse (400).
    shed_id, shed = _tenant(fair_server, ttft_target_s=0.001, cost_per_minute=1)
    untokenizable = [*_prompt(8000, 8), 10**9]
    unreservable = _prompt(8001, 8)
    flood = [asyncio.create_task(_complete(heavy, model, _prompt(8100 + i, 1900), 4)) for i in range(20)]
    await asyncio.to_thread(wait_until, lambda: fair_server.admin("engine")["waiting"] >= 10, 60.0, "a flood")
    refusals = []
    for prompt in (untokenizable, unreservable):
        with pytest.raises(openai.APIStatusError) as refused:
            await shed.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        refusals.append(refused.value)
    assert fair_server.admin("engine")["waiting"] > 0  # both were answered while the flood was queued
    for refused in refusals:
        assert refused.status_code == 503 and refused.body["code"] == "server_overloaded"
        assert int(refused.response.headers["retry-after"]) >= 1
    assert fair_server.wait_shed_reasons(shed_id, 2) == ["slo", "slo"]  # and recorded, not as a quota refusal
    await asyncio.gather(*flood)
    # With nothing queued, the same requests get as far as the tokenizer and the reservation.
    with pytest.raises(openai.BadRequestError):
        await shed.completions.create(model=model, prompt=untokenizable, max_tokens=4, temperature=0)
    with pytest.raises(openai.RateLimitError):
        await shed.completions.create(model=model, prompt=unreservable, max_tokens=4, temperature=0)
    assert sorted(fair_server.wait_shed_reasons(shed_id, 3)) == ["rate", "slo", "slo"]
    assert fair_server.usage_rows(shed_id) == []
    wait_until(fair_server.engine_idle, what="all KV blocks free after the flood")


async def test_a_request_that_cannot_start_by_its_deadline_is_refused_before_any_byte(
    fair_server: ApiServer,
) -> None:
    model = _model(fair_server)
    blocker_id, blocker = _tenant(fair_server, ttft_target_s=PATIENT_S)
    late_id, late = _tenant(fair_server, ttft_target_s=1.0)
    # Two long decodes hold both running places; a step beside them takes far less than the late tenant's
    # target, so admission lets its requests in, and they wait for a place past their deadline.
    streams = [
        await blocker.completions.create(
            model=model, prompt=_prompt(7000 + i, 8), max_tokens=2000, temperature=0, stream=True
        )
        for i in range(2)
    ]
    firsts = [await anext(aiter(stream)) for stream in streams]
    assert all(first.choices for first in firsts)
    with pytest.raises(openai.APIStatusError) as streamed:
        await late.completions.create(model=model, prompt=_prompt(7100, 8), max_tokens=4, stream=True)
    with pytest.raises(openai.APIStatusError) as whole:
        await late.completions.create(model=model, prompt=_prompt(7101, 8), max_tokens=4)
    for refused in (streamed.value, whole.value):
        assert refused.status_code == 503
        assert refused.body["code"] == "server_overloaded" and "time to first token" in refused.message
        assert int(refused.response.headers["retry-after"]) >= 1
    for stream in streams:
        await stream.close()
    assert fair_server.wait_shed_reasons(late_id, 2) == ["deadline", "deadline"]
    fair_server.wait_usage(blocker_id, 2)  # written after the refusals were settled
    assert fair_server.usage_rows(late_id) == []  # refused, not billed
    wait_until(fair_server.engine_idle, what="all KV blocks free after the refusals")
