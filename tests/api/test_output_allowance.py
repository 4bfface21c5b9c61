"""A chat request without max_tokens reserves a default output allowance and extends it while the answer
grows; a refused extension ends the answer with "length" at exactly the reserved tokens, billed as such,
and the tenant's quota comes back whole."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from api.output_allowance import CHAT_ALLOWANCE, EXTENSION
from engine.tokenizer import Tokenizer
from tests.api.server import ApiServer, run_db, wait_until

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
CONTEXT = 2048  # the tiny model's context window


@pytest.fixture(scope="module")
def prompt_tokens(tiny_model_dir: Path) -> int:
    return len(Tokenizer(tiny_model_dir).apply_chat_template(MESSAGES))


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _client(server: ApiServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def _reference(server: ApiServer, make_tenant, max_tokens: int) -> str:
    """The greedy answer of an unlimited tenant that asked for ``max_tokens``."""
    _, key = make_tenant()
    reply = _client(server, key).chat.completions.create(
        model=_model(server), messages=MESSAGES, max_tokens=max_tokens, temperature=0
    )
    assert reply.usage.completion_tokens == max_tokens  # the tiny model does not stop this early
    return reply.choices[0].message.content


def _assert_quota_returns(server: ApiServer, tenant_id: int) -> None:
    """Once the server's free slices go back, the tenant's spend is its ledger's and no slot is held."""

    async def state(db: AsyncEngine) -> sa.Row:
        async with db.connect() as conn:
            query = "SELECT in_flight, period_spent FROM quota_state WHERE tenant_id = :t"
            return (await conn.execute(sa.text(query), {"t": tenant_id})).one()

    def settled() -> bool:
        row = run_db(server.database_url, state)
        billed = float(sum(r["cost"] for r in server.usage_rows(tenant_id)))  # the ledger is exact
        return row.in_flight == 0 and abs(row.period_spent - billed) < 1e-6

    wait_until(settled, what=f"tenant {tenant_id}'s quota back to its ledger")


def test_chat_without_max_tokens_fits_a_small_per_minute_limit(
    api_server: ApiServer, make_tenant, prompt_tokens: int
) -> None:
    per_minute = 300  # far less than one full-context reservation: prompt + 2 * (context - prompt)
    tenant_id, key = make_tenant(cost_per_minute=per_minute)
    client = _client(api_server, key)
    model = _model(api_server)
    with pytest.raises(openai.RateLimitError) as full:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=CONTEXT - prompt_tokens, temperature=0
        )
    assert full.value.code == "rate_limit_exceeded"
    assert full.value.response.headers["x-should-retry"] == "false"

    raw = client.chat.completions.with_raw_response.create(model=model, messages=MESSAGES, temperature=0)
    reply = raw.parse()
    tokens = reply.usage.completion_tokens
    assert reply.choices[0].finish_reason in ("length", "stop") and tokens >= 1
    assert reply.choices[0].message.content == _reference(api_server, make_tenant, tokens)
    row = api_server.wait_usage_row(reply.id)
    assert (row["status"], row["finish_reason"]) == ("ok", reply.choices[0].finish_reason)
    assert row["output_tokens"] == tokens and row["cost"] == prompt_tokens + 2 * tokens
    _assert_quota_returns(api_server, tenant_id)


def test_answer_grows_until_an_extension_is_refused(
    api_server: ApiServer, make_tenant, prompt_tokens: int
) -> None:
    granted = CHAT_ALLOWANCE + EXTENSION  # the allowance and one extension fit the budget, a second does not
    budget = prompt_tokens + 2 * granted + 100
    tenant_id, key = make_tenant(cost_per_minute=3000, monthly_budget=budget)
    assert prompt_tokens + 2 * (CONTEXT - prompt_tokens) > 3000  # a full-context reservation is refused
    stream = _client(api_server, key).chat.completions.create(
        model=_model(api_server),
        messages=MESSAGES,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage
    assert usage.completion_tokens == granted
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == _reference(api_server, make_tenant, granted)
    row = api_server.wait_usage_row(chunks[0].id)
    assert (row["status"], row["finish_reason"], row["output_tokens"]) == ("ok", "length", granted)
    assert row["cost"] == prompt_tokens + 2 * granted <= budget
    wait_until(api_server.engine_idle, what="all KV blocks free after the cut")
    _assert_quota_returns(api_server, tenant_id)


async def test_disconnect_while_the_allowance_grows_settles_once(
    api_server: ApiServer, make_tenant, prompt_tokens: int
) -> None:
    tenant_id, key = make_tenant(cost_per_minute=3000)
    body = {"model": _model(api_server), "messages": MESSAGES, "temperature": 0, "stream": True}
    chunks = []
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream(
            "POST", f"{api_server.v1}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if len(chunks) == 1 + CHAT_ALLOWANCE:  # the role, then at least the first allowance's tokens
                break
    row = api_server.wait_usage_row(chunks[0]["id"])
    assert (row["status"], row["finish_reason"]) == ("cancelled", "abort")
    assert CHAT_ALLOWANCE <= row["output_tokens"] < CONTEXT - prompt_tokens
    assert row["cost"] == prompt_tokens + 2 * row["output_tokens"]
    wait_until(api_server.engine_idle, what="all KV blocks free after the disconnect")
    _assert_quota_returns(api_server, tenant_id)
