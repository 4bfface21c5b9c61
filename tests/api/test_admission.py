"""Admission against the TTFT target: an idle server answers every request; a real overload still sheds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.api.server import ApiServer

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
