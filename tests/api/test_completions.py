"""The official ``openai`` client, sync and async, streamed and not, against a real ``weir serve``."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.server import ApiServer

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _assert_ledger_matches(
    server: ApiServer, tenant_id: int, request_id: str, usage, finish_reason: str
) -> None:
    row = server.wait_usage_row(request_id)
    assert row["tenant_id"] == tenant_id
    assert row["status"] == "ok"
    assert row["finish_reason"] == finish_reason
    assert row["prompt_tokens"] == usage.prompt_tokens
    assert row["output_tokens"] == usage.completion_tokens
    assert row["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert row["cost"] > 0 and row["ttft_s"] is not None and row["e2e_s"] >= row["ttft_s"]


def test_sync_chat_non_streamed_is_billed_as_reported(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant()
    client = openai.OpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    [model] = [m.id for m in client.models.list()]
    assert client.models.retrieve(model).id == model
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=MESSAGES, max_tokens=12, temperature=0
    )
    reply = raw.parse()
    assert raw.headers["x-request-id"] == reply.id
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 12
    _assert_ledger_matches(api_server, tenant_id, reply.id, reply.usage, "length")


async def test_async_stream_framing_usage_and_greedy_equality(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant()
    client = openai.AsyncOpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    model = _model(api_server)
    whole = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, temperature=0)
    stream = await client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert content[-1].choices[0].finish_reason == "length"
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content
    assert final.usage.completion_tokens == 10 and final.usage.total_tokens == final.usage.prompt_tokens + 10
    assert len({c.id for c in chunks}) == 1
    _assert_ledger_matches(api_server, tenant_id, final.id, final.usage, "length")


def test_stop_string_ends_with_stop_and_is_not_emitted(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    client = openai.OpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    model = _model(api_server)
    free = client.completions.create(
        model=model, prompt="The lighthouse keeper", max_tokens=12, temperature=0
    )
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    stopped = client.completions.create(
        model=model, prompt="The lighthouse keeper", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.usage.completion_tokens < 12


def test_seed_reproducible_and_token_id_prompts(api_server: ApiServer, make_tenant) -> None:
    _, key = make_tenant()
    client = openai.OpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    model = _model(api_server)

    def sample(seed: int) -> str:
        reply = client.completions.create(
            model=model, prompt=[5, 17, 923, 4096], max_tokens=8, temperature=1.0, seed=seed
        )
        assert reply.usage.prompt_tokens == 4
        return reply.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert any(sample(seed) != first for seed in (8, 9, 10))


async def test_async_completions_stream(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant()
    client = openai.AsyncOpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    stream = await client.completions.create(
        model=_model(api_server),
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in content)
    _assert_ledger_matches(api_server, tenant_id, chunks[-1].id, chunks[-1].usage, "length")


def test_probes(api_server: ApiServer) -> None:
    assert httpx.get(f"{api_server.base_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{api_server.base_url}/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_a_repeated_system_prompt_is_cached_and_billed_at_the_cached_weight(
    api_server: ApiServer, make_tenant
) -> None:
    tenant_id, key = make_tenant()
    client = openai.OpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    system = {"role": "system", "content": "You answer questions about lighthouses. " * 20}
    replies = [
        client.chat.completions.create(
            model=_model(api_server),
            messages=[system, {"role": "user", "content": question}],
            max_tokens=3,
            temperature=0,
        )
        for question in ("Who keeps them?", "How tall is the tallest one?")
    ]
    first, second = (reply.usage for reply in replies)
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 150 < second.prompt_tokens_details.cached_tokens < second.prompt_tokens
    row = api_server.wait_usage_row(replies[1].id)
    cached = second.prompt_tokens_details.cached_tokens
    assert row["cached_tokens"] == cached
    expected = (second.prompt_tokens - cached) * 1.0 + cached * 0.1 + second.completion_tokens * 2.0
    assert float(row["cost"]) == pytest.approx(expected, rel=1e-9)


CONTEXT = 2048  # the tiny model's context window (its max_position_embeddings; the KV pool holds more)


async def test_answers_that_reach_the_context_window_end_with_length(
    api_server: ApiServer, make_tenant
) -> None:
    """Without ``max_tokens`` an answer may run to the end of the context window, and ends there with
    ``length``: a completion (whose default of 16 tokens is more than the room left) and a chat."""
    tenant_id, key = make_tenant()
    client = openai.AsyncOpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    model = _model(api_server)
    prompt = [3 + (11 * i) % 40000 for i in range(CONTEXT - 6)]
    whole = await client.completions.create(model=model, prompt=prompt, temperature=0)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (CONTEXT - 6, 6)
    assert whole.choices[0].finish_reason == "length"
    _assert_ledger_matches(api_server, tenant_id, whole.id, whole.usage, "length")

    words = "the " * (CONTEXT - 64)  # a token a word; the chat template adds a few dozen more
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": words}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert ends == ["length"]
    usage = chunks[-1].usage
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT and usage.completion_tokens > 0
    _assert_ledger_matches(api_server, tenant_id, chunks[-1].id, usage, "length")
