"""Every refusal in OpenAI's envelope with the right status, checked through the SDK's exception classes."""

from __future__ import annotations

import httpx
import openai
import pytest

from tenants.admin import create_key, revoke_key, set_tenant_status
from tenants.db import EmbeddedPostgres
from tests.api.server import ApiServer, run_db, wait_until

MESSAGES = [{"role": "user", "content": "Hi"}]


def _client(server: ApiServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_auth_refusals(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant()
    url = f"{api_server.v1}/chat/completions"
    body = {"model": _model(api_server), "messages": MESSAGES}
    assert _envelope(httpx.post(url, json=body), 401)["code"] == "missing_api_key"
    assert _envelope(httpx.post(url, json=body, headers={"Authorization": "Basic abc"}), 401)
    with pytest.raises(openai.AuthenticationError) as unknown:
        _client(api_server, "wk-" + "x" * 43).chat.completions.create(model=body["model"], messages=MESSAGES)
    assert unknown.value.code == "invalid_api_key"

    revoked_key, revoked_secret = run_db(api_server.database_url, create_key, tenant_id)
    run_db(api_server.database_url, revoke_key, revoked_key.id)
    with pytest.raises(openai.AuthenticationError) as revoked:
        _client(api_server, revoked_secret).models.list()
    assert revoked.value.code == "revoked_key"

    run_db(api_server.database_url, set_tenant_status, tenant_id, "suspended")
    with pytest.raises(openai.AuthenticationError) as suspended:
        _client(api_server, key).chat.completions.create(model=body["model"], messages=MESSAGES)
    assert suspended.value.code == "tenant_suspended"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["ok", "x" * 257]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hello"}, "messages"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 100_000}, "messages"),
        ({"max_tokens": 1500}, "max_tokens"),  # above the tenant's max output tokens
        ({"max_completion_tokens": 1500}, "max_completion_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5, "logit_bias": {"42": 5}}, "frequency_penalty"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(
    api_server: ApiServer, make_tenant, extra, param
) -> None:
    _, key = make_tenant(max_output_tokens=1000)
    body = {"model": _model(api_server), "messages": MESSAGES, **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        _client(api_server, key).chat.completions.create(**body)
    assert refused.value.status_code == 400
    assert refused.value.param == param
    if param in extra and param not in ("max_tokens", "max_completion_tokens"):
        assert refused.value.code in ("invalid_value", "unsupported_parameter", None)
    if extra.get("max_tokens") == 100_000:
        assert refused.value.code == "context_length_exceeded"


def test_fields_that_do_not_change_the_answer_are_accepted(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    answer = _client(api_server, key).chat.completions.create(
        model=_model(api_server),
        messages=MESSAGES,
        max_tokens=3,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        logprobs=False,
        presence_penalty=0,
        metadata={"team": "a"},
        store=False,
    )
    assert answer.choices[0].message.content is not None


def test_deeply_nested_json_is_a_400(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for depth in (1000, 50_000):
        body = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        error = _envelope(httpx.post(f"{api_server.v1}/completions", content=body, headers=headers), 400)
        assert error["code"] == "invalid_json" and "nested" in error["message"]


def test_malformed_bodies_unknown_model_and_routes(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{api_server.v1}/completions"
    assert _envelope(httpx.post(url, content=b'{"model": "x", "prompt": ', headers=headers), 400)["code"] == (
        "invalid_json"
    )
    assert _envelope(httpx.post(url, content=b"[1, 2]", headers=headers), 400)
    assert _envelope(httpx.post(url, content=b"\xff\xfe", headers=headers), 400)
    missing = _envelope(httpx.post(url, json={"prompt": "x"}, headers=headers), 400)
    assert missing["param"] == "model" and missing["code"] == "missing_required_parameter"
    too_long = {"model": _model(api_server), "prompt": "word " * 400_000}
    assert _envelope(httpx.post(url, json=too_long, headers=headers), 413)["code"] == "request_too_large"
    assert _envelope(httpx.post(f"{api_server.v1}/nothing", json={}, headers=headers), 404)
    assert _envelope(httpx.delete(url, headers=headers), 405)
    assert _envelope(httpx.post(f"{api_server.base_url}/admin/api/engine"), 405)
    assert _envelope(httpx.get(f"{api_server.base_url}/admin/api/engine"), 401)
    for token in ("wrong", "ünïcödé-tøken".encode().decode("latin-1"), "x" * 5000):
        wrong = {"Authorization": f"Bearer {token}".encode("latin-1")}
        assert _envelope(httpx.get(f"{api_server.base_url}/admin/api/engine", headers=wrong), 401)

    unknown_field = {
        "model": _model(api_server),
        "prompt": "x",
        "max_tokens": 1,
        "logit_bias": {},
        "zzz": [1],
    }
    assert httpx.post(url, json=unknown_field, headers=headers).status_code == 200

    with pytest.raises(openai.NotFoundError) as missing:
        _client(api_server, key).completions.create(model="gpt-17", prompt="x")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        _client(api_server, key).models.retrieve("gpt-17")
    assert len(api_server.wait_usage(tenant_id, 1)) == 1  # only the one request that ran is billed


def test_rate_limit_429_with_headers(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant(cost_per_minute=200)
    client = _client(api_server, key)
    model = _model(api_server)
    first = client.completions.create(model=model, prompt=[7] * 20, max_tokens=60, temperature=0)
    assert first.usage.completion_tokens == 60  # the tiny model does not stop early: 20 + 2*60 = 140 spent
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model=model, prompt=[7] * 20, max_tokens=60, temperature=0)
    error, headers = limited.value, limited.value.response.headers
    assert error.code == "rate_limit_exceeded"
    assert headers["x-ratelimit-limit-cost"] == "200"
    assert float(headers["x-ratelimit-remaining-cost"]) < 140
    assert headers["x-ratelimit-reset-cost"].endswith("s")
    assert int(headers["retry-after"]) >= 1


def test_concurrency_limit_429(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant(max_concurrency=1)
    client = _client(api_server, key)
    model = _model(api_server)
    with client.completions.create(model=model, prompt="x", max_tokens=400, stream=True) as stream:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as limited:
            client.completions.create(model=model, prompt="x", max_tokens=5)
    headers = limited.value.response.headers
    assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "retry-after" in headers and headers["x-ratelimit-reset-requests"].endswith("s")
    assert api_server.wait_shed_reasons(tenant_id) == ["concurrency"]


def test_spent_budget_is_insufficient_quota_not_retried(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant(monthly_budget=0)
    with pytest.raises(openai.RateLimitError) as refused:
        openai.OpenAI(base_url=api_server.v1, api_key=key).completions.create(
            model=_model(api_server), prompt="x", max_tokens=5
        )
    assert refused.value.code == "insufficient_quota" and refused.value.type == "insufficient_quota"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert api_server.wait_shed_reasons(tenant_id) == ["budget"]  # one attempt: the client did not retry


def test_an_unreachable_database_is_a_503_during_auth_and_reservation(
    admission_server: ApiServer, admission_postgres: tuple[EmbeddedPostgres, str]
) -> None:
    """With its database stopped, the server answers a key it has not seen (auth) and a key it knows but
    a tenant it has reserved nothing for (the reservation) with a retryable 503, and recovers once the
    database is back."""
    server, (postgres, _) = admission_server, admission_postgres
    model = _model(server)
    _, unseen = run_db(server.database_url, server.create_tenant)
    known_id, known = run_db(server.database_url, server.create_tenant, cost_per_minute=10_000)
    assert _client(server, known).models.list().data  # its key is now cached (for 5 s)
    url = f"{server.v1}/completions"
    body = {"model": model, "prompt": "x", "max_tokens": 1}
    postgres.stop()
    try:
        assert _client(server, known).models.list().data, "the known key was looked up again, not cached"
        for key, stream in ((known, True), (known, False), (unseen, False)):
            response = httpx.post(
                url, json={**body, "stream": stream}, headers={"Authorization": f"Bearer {key}"}
            )
            error = _envelope(response, 503)
            assert error["code"] == "service_unavailable" and error["type"] == "server_error"
            assert response.headers["retry-after"] == "2"
    finally:
        postgres.start()

    def answered() -> bool:  # pooled connections to the stopped server are found dead one by one
        return httpx.post(url, json=body, headers={"Authorization": f"Bearer {unseen}"}).status_code == 200

    wait_until(answered, what="an answer once the database is back")
    assert server.usage_rows(known_id) == []  # the refused requests were not billed
