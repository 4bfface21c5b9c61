"""Admission against the TTFT target: an idle server answers every request; a real overload still sheds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import AsyncStream
from openai.types import Completion

from tests.api.conftest import ADMISSION_MAX_WAITING
from tests.api.server import ApiServer, run_db, wait_until

PROMPT_SIZES = (16, 64, 256, 1024, 2000)  # token ids; the tiny model's context is 2048
# A target no estimate meets: whatever the step-time model says, shedding would refuse.
UNREACHABLE_TTFT_S = 1e-6
BUSY_LOOP = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture(params=["quiet", "busy"])
def cpu(request: pytest.FixtureRequest) -> Iterator[str]:
    """The machine as it is, or with both cores kept busy by competing processes for the test's length."""
    procs = []
    if request.param == "busy":
        procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(2)]
    try:
        yield request.param
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def test_sequential_requests_on_an_idle_server_are_answered(
    api_server: ApiServer, make_tenant, cpu: str
) -> None:
    _, key = make_tenant(ttft_target_s=UNREACHABLE_TTFT_S)
    client = openai.OpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    model = _model(api_server)
    # First feed the step-time model a long run of decode-only steps (slow ones when the CPU is busy).
    long = client.completions.create(model=model, prompt=[5], max_tokens=200, temperature=0)
    assert long.usage.completion_tokens >= 1
    for size in PROMPT_SIZES:
        prompt = [(7 * i) % 40000 + 3 for i in range(size)]
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert answer.usage.prompt_tokens == size
    for content in ("Hi", "What is the capital of France? " * 10):
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=8
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
    engine = api_server.admin("engine")
    assert engine["ttft_estimate_ratio_p50"] is not None


async def _burst(server: ApiServer, key: str, model: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as http:

        async def one(i: int) -> httpx.Response:
            return await http.post(
                f"{server.v1}/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": model, "prompt": [3 + i] * 2000, "max_tokens": 4, "temperature": 0},
            )

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_a_real_overload_still_sheds_with_slo(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant(ttft_target_s=UNREACHABLE_TTFT_S)
    responses = asyncio.run(_burst(api_server, key, _model(api_server), 24))
    statuses = [r.status_code for r in responses]
    assert 200 in statuses, statuses  # the first of the burst has nothing queued ahead
    shed = [r for r in responses if r.status_code == 503]
    assert shed, statuses  # those that arrived behind queued prefill would miss the target
    for response in shed:
        error = response.json()["error"]
        assert error["code"] == "server_overloaded" and "time to first token" in error["message"]
        assert int(response.headers["retry-after"]) >= 1
    # shed on arrival, or admitted with nothing queued ahead and then refused unstarted past the deadline
    reasons = set(api_server.wait_shed_reasons(tenant_id, len(shed)))
    assert "slo" in reasons and reasons <= {"slo", "deadline"}
    assert len(api_server.wait_usage(tenant_id, statuses.count(200))) == statuses.count(200)


PATIENT_S = 600.0  # a TTFT target no request here misses: the other checks decide
HOLD_TOKENS = 2000  # a holder's answer: it keeps the one running place while a test fills the queue


def _tenant(server: ApiServer, **options) -> tuple[int, openai.AsyncOpenAI]:
    tenant_id, key = run_db(server.database_url, server.create_tenant, **options)
    return tenant_id, openai.AsyncOpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)


def _patient_tenants(server: ApiServer) -> list[tuple[int, openai.AsyncOpenAI]]:
    """Two tenants whose TTFT target no request here misses."""
    return [_tenant(server, ttft_target_s=PATIENT_S) for _ in range(2)]


def _prompt(seed: int, size: int) -> list[int]:
    """Token ids that share no block with another request's (the prefix cache plays no part)."""
    return [3 + (seed * 7919 + j) % 40000 for j in range(size)]


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> int:
    answer = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return answer.usage.completion_tokens


async def _hold(
    client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int
) -> tuple[AsyncStream[Completion], str]:
    """A stream that has started, and its request id: it holds the server's one running place until it is
    closed."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    first = await anext(aiter(stream))
    assert first.choices
    return stream, first.id


async def _refused(client: openai.AsyncOpenAI, model: str, prompt: list[int], why: str) -> None:
    """The request is shed: a 503 ``server_overloaded`` saying ``why``, with ``Retry-After``."""
    with pytest.raises(openai.APIStatusError) as refused:
        await _complete(client, model, prompt)
    error = refused.value
    assert error.status_code == 503 and error.body["code"] == "server_overloaded", error.body
    assert why in error.message and int(error.response.headers["retry-after"]) >= 1


async def _wait_waiting(server: ApiServer, tenant_id: int, count: int) -> None:
    """Until ``count`` of the tenant's requests wait in the engine."""

    def waiting() -> bool:
        return server.admin("engine")["waiting_by_tenant"].get(str(tenant_id), 0) == count

    await asyncio.to_thread(wait_until, waiting, 30.0, f"{count} waiting requests of tenant {tenant_id}")


async def _release(
    server: ApiServer, holder: tuple[AsyncStream[Completion], str], queued: list[asyncio.Task]
) -> None:
    """Close the holder (cut, so it held the running place throughout) and let the queued requests run."""
    stream, request_id = holder
    await stream.close()
    assert await asyncio.gather(*queued) == [1] * len(queued)
    row = await asyncio.to_thread(server.wait_usage_row, request_id)
    assert row["status"] == "cancelled", "the holder ended before the test released it"
    await asyncio.to_thread(wait_until, server.engine_idle, 30.0, "all KV blocks free")


async def test_a_full_queue_refuses_a_tenant_holding_its_share_of_the_places(
    admission_server: ApiServer,
) -> None:
    server, model = admission_server, _model(admission_server)
    (flood_id, flood), (other_id, other) = _patient_tenants(server)
    holder = await _hold(flood, model, _prompt(100, 8), HOLD_TOKENS)
    places = ADMISSION_MAX_WAITING
    queued = [asyncio.create_task(_complete(flood, model, _prompt(101 + i, 8))) for i in range(places)]
    await _wait_waiting(server, flood_id, places)
    await _refused(flood, model, _prompt(120, 8), "too many requests are waiting")
    # Another tenant still gets its share of the places (the cap over the two tenants waiting), beyond the
    # cap; then it is refused too, and so is the flooding tenant.
    queued += [asyncio.create_task(_complete(other, model, _prompt(130 + i, 8))) for i in range(places // 2)]
    await _wait_waiting(server, other_id, places // 2)
    await _refused(other, model, _prompt(140, 8), "too many requests are waiting")
    await _refused(flood, model, _prompt(121, 8), "too many requests are waiting")
    await _release(server, holder, queued)
    assert server.wait_shed_reasons(flood_id, 2) == ["queue", "queue"]
    assert server.wait_shed_reasons(other_id, 1) == ["queue"]
    assert len(server.wait_usage(flood_id, 1 + places)) == 1 + places
    assert len(server.wait_usage(other_id, places // 2)) == places // 2


async def test_a_prompt_beyond_the_free_kv_is_refused_behind_the_tenants_own_waiting_requests(
    admission_server: ApiServer,
) -> None:
    server, model = admission_server, _model(admission_server)
    (holder_id, holder_client), (fresh_id, fresh) = _patient_tenants(server)
    # 1000 prompt tokens and more as it runs: 63 of the 128 blocks and more are held, at most 65 are free
    holder = await _hold(holder_client, model, _prompt(200, 1000), 1000)
    large = 1100  # tokens: 69 blocks
    queued = [asyncio.create_task(_complete(holder_client, model, _prompt(201, 8)))]
    await _wait_waiting(server, holder_id, 1)
    await _refused(holder_client, model, _prompt(210, large), "KV cache is full")
    # A tenant with nothing waiting is admitted with the same prompt (it waits for memory, first in its
    # tenant's line); its next one waits behind it, and is refused.
    queued.append(asyncio.create_task(_complete(fresh, model, _prompt(220, large))))
    await _wait_waiting(server, fresh_id, 1)
    await _refused(fresh, model, _prompt(221, large), "KV cache is full")
    await _release(server, holder, queued)
    assert server.wait_shed_reasons(holder_id, 1) == ["kv"]
    assert server.wait_shed_reasons(fresh_id, 1) == ["kv"]
    assert len(server.wait_usage(holder_id, 2)) == 2 and len(server.wait_usage(fresh_id, 1)) == 1


async def test_a_tenant_over_its_share_is_shed_where_one_under_it_is_admitted(
    admission_server: ApiServer,
) -> None:
    """The same request, predicted to start as soon, of two tenants with the same TTFT target: the one
    served far beyond its share lately is shed (its limit is the target over its share ratio)."""
    server, model = admission_server, _model(admission_server)
    target_s = 5.0
    # A tiny weight makes the fair share of the tenant served most (the holder's) a millionth of the service
    over_id, over = _tenant(server, ttft_target_s=target_s, weight=1e-6)
    under_id, under = _tenant(server, ttft_target_s=target_s)
    assert await _complete(under, model, _prompt(300, 8)) == 1  # it has sent: it shares the service
    holder = await _hold(over, model, _prompt(301, 8), HOLD_TOKENS)
    for _ in range(100):  # served a while: most of the recent service is the holder's
        await anext(aiter(holder[0]))
    await _refused(over, model, _prompt(302, 256), "time to first token")
    queued = [asyncio.create_task(_complete(under, model, _prompt(303, 256)))]
    await _wait_waiting(server, under_id, 1)  # admitted: it waits for the running place
    await _release(server, holder, queued)
    assert server.wait_shed_reasons(over_id, 1) == ["slo"]
    assert server.shed_reasons(under_id) == []
