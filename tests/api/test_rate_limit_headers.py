"""OpenAI's ``x-ratelimit-*`` headers on every answer of the completion routes, from the tenant's allowance:
requests are concurrency slots, tokens the per-minute cost bucket."""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from tests.api.server import ApiServer

PROMPT = [7] * 20  # with 60 output tokens (the tiny model does not stop early): 20 + 2 * 60 = 140 cost units
OUTPUT = 60
COST = 140
PER_MINUTE = 600  # refills 10 cost units a second
NAMES = ("limit", "remaining", "reset")


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _client(server: ApiServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def _rate_limits(headers: httpx.Headers) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.startswith("x-ratelimit-")}


def _assert_allowance(headers: httpx.Headers, slots_left: int) -> int:
    """The six OpenAI headers (and the cost ones) for a tenant allowed 4 requests at once and 600 cost
    units a minute; returns the remaining tokens."""
    assert headers["x-ratelimit-limit-requests"] == "4"
    assert headers["x-ratelimit-remaining-requests"] == str(slots_left)
    assert headers["x-ratelimit-reset-requests"] == "0s"
    assert headers["x-ratelimit-limit-tokens"] == str(PER_MINUTE)
    remaining = int(headers["x-ratelimit-remaining-tokens"])
    assert 0 <= remaining <= PER_MINUTE
    assert headers["x-ratelimit-reset-tokens"].endswith("s")
    for name in NAMES:
        assert headers[f"x-ratelimit-{name}-cost"] == headers[f"x-ratelimit-{name}-tokens"]
    return remaining


def test_whole_and_streamed_answers_carry_the_allowance(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(cost_per_minute=PER_MINUTE, max_concurrency=4)
    client = _client(api_server, key)
    model = _model(api_server)
    whole = client.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=OUTPUT, temperature=0
    )
    assert whole.parse().usage.completion_tokens == OUTPUT
    _assert_allowance(whole.headers, slots_left=3)

    streamed = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, stream=True
    )
    _assert_allowance(streamed.headers, slots_left=3)  # the first request's slot came back when it ended
    assert [c for c in streamed.parse() if c.choices and c.choices[0].finish_reason]


def test_remaining_tokens_fall_by_each_reservation(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(cost_per_minute=PER_MINUTE, max_concurrency=4)
    client = _client(api_server, key)
    model = _model(api_server)
    start = time.monotonic()
    previous = previous_sent = None
    for i in range(3):
        sent = time.monotonic()
        raw = (
            client.completions.with_raw_response.create(  # a prompt of its own: nothing comes from the cache
                model=model, prompt=[7 + i] * len(PROMPT), max_tokens=OUTPUT, temperature=0
            )
        )
        assert raw.parse().usage.completion_tokens == OUTPUT  # billed exactly what was reserved
        remaining = _assert_allowance(raw.headers, slots_left=3)
        if previous is None:  # a full bucket less this reservation, plus what refilled since
            assert PER_MINUTE - COST - 1 <= remaining <= PER_MINUTE - COST + 10 * (time.monotonic() - start)
        else:  # less by this reservation, plus at most the refill since the previous request was sent
            refill = 10 * (time.monotonic() - previous_sent)
            assert previous - COST - 1 <= remaining <= previous - COST + refill + 1
        previous, previous_sent = remaining, sent


def test_unlimited_tenant_gets_no_rate_limit_headers(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(monthly_budget=1_000_000)
    raw = _client(api_server, key).completions.with_raw_response.create(
        model=_model(api_server), prompt=PROMPT, max_tokens=2
    )
    assert raw.parse().usage.completion_tokens == 2
    assert _rate_limits(raw.headers) == {}


def test_refusals_after_auth_carry_the_allowance(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(cost_per_minute=PER_MINUTE, max_concurrency=4)
    url = f"{api_server.v1}/completions"
    auth = {"Authorization": f"Bearer {key}"}
    model = _model(api_server)
    bad_json = httpx.post(url, content=b'{"model": ', headers={**auth, "Content-Type": "application/json"})
    bad_value = httpx.post(url, json={"model": model, "prompt": "x", "temperature": 9}, headers=auth)
    unknown_model = httpx.post(url, json={"model": "gpt-17", "prompt": "x"}, headers=auth)
    for response, status in ((bad_json, 400), (bad_value, 400), (unknown_model, 404)):
        assert response.status_code == status, response.text
        assert _assert_allowance(response.headers, slots_left=4) == PER_MINUTE  # nothing reserved yet
    assert _rate_limits(httpx.post(url, json={"model": model, "prompt": "x"}).headers) == {}  # before auth


def test_rate_refusal_says_what_is_left(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(cost_per_minute=200, max_concurrency=4)
    client = _client(api_server, key)
    model = _model(api_server)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=OUTPUT, temperature=0)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=OUTPUT, temperature=0)
    headers = limited.value.response.headers
    assert headers["x-ratelimit-limit-tokens"] == "200"
    assert int(headers["x-ratelimit-remaining-tokens"]) < COST
    assert headers["x-ratelimit-remaining-requests"] == "4"  # a refused request holds no slot
    assert int(headers["retry-after"]) >= 1


def _retry_after_ms(headers: httpx.Headers) -> int:
    """``retry-after-ms``, checked against ``retry-after`` (the same wait, in whole seconds rounded up)."""
    milliseconds = int(headers["retry-after-ms"])
    assert milliseconds >= 1 and int(headers["retry-after"]) == max(1, math.ceil(milliseconds / 1000))
    return milliseconds


def test_rate_and_concurrency_refusals_say_when_to_retry_in_milliseconds(
    api_server: ApiServer, make_tenant
) -> None:
    model = _model(api_server)
    _, one_at_a_time = make_tenant(max_concurrency=1)
    client = _client(api_server, one_at_a_time)
    with client.completions.create(model=model, prompt="x", max_tokens=400, stream=True) as stream:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as busy:
            client.completions.create(model=model, prompt="x", max_tokens=5)
    assert _retry_after_ms(busy.value.response.headers) == 1000  # a slot: retry in a second

    _, rate_limited = make_tenant(cost_per_minute=200)
    client = _client(api_server, rate_limited)
    client.completions.create(model=model, prompt=PROMPT, max_tokens=OUTPUT, temperature=0)
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=OUTPUT, temperature=0)
    # the bucket refills 200 cost units a minute: a request of COST units waits at most the time it takes
    # to refill them all
    assert _retry_after_ms(limited.value.response.headers) <= math.ceil(COST * 60_000 / 200)
