"""Clients that leave or stop reading: the engine request ends, its KV blocks come back, the partial output
is billed once, the reservation is settled, and other tenants' streams keep flowing."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.api.conftest import CLIENT_TIMEOUT_S
from tests.api.server import ApiServer, wait_until

LONG = 1500  # output tokens the tiny model would produce if nobody stopped it (it rarely emits EOS)
CLOSED_WITHIN_S = 10.0  # the longest wait for the end of a connection the server has already dropped


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _long_request(server: ApiServer, stream: bool) -> dict:
    """A greedy request that would run for LONG tokens."""
    return {
        "model": _model(server),
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": stream,
    }


def _assert_settled(server: ApiServer, key: str) -> None:
    """With max_concurrency=1, a new request only passes once the previous reservation was settled."""
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    reply = client.completions.create(model=_model(server), prompt="x", max_tokens=2)
    assert reply.usage.completion_tokens == 2


async def test_disconnect_mid_stream_frees_blocks_and_bills_partial(
    api_server: ApiServer, make_tenant
) -> None:
    tenant_id, key = make_tenant(max_concurrency=1)
    body = _long_request(api_server, stream=True)
    headers = {"Authorization": f"Bearer {key}"}
    chunks = []
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", f"{api_server.v1}/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if len(chunks) == 5:
                break
    stats = wait_until(api_server.engine_idle, what="all KV blocks free after the disconnect")
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    row = api_server.wait_usage_row(chunks[0]["id"])
    assert (row["status"], row["finish_reason"]) == ("cancelled", "abort")
    assert 5 <= row["output_tokens"] < LONG
    assert row["cost"] == pytest.approx(row["prompt_tokens"] + 2 * row["output_tokens"])
    _assert_settled(api_server, key)


def _send(server: ApiServer, key: str, body: dict, receive_buffer: int | None = None) -> socket.socket:
    """A connection that has sent ``body`` to /v1/completions and read nothing of the answer yet."""
    address = urlsplit(server.base_url)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((address.hostname, address.port))
    sock.sendall(request)
    return sock


def _running(server: ApiServer) -> bool:
    return server.admin("engine")["running"] >= 1


def test_disconnect_while_waiting_for_a_whole_answer(api_server: ApiServer, make_tenant) -> None:
    tenant_id, key = make_tenant(max_concurrency=1)
    with _send(api_server, key, _long_request(api_server, stream=False)):
        wait_until(lambda: _running(api_server), what="the request running")
    # the client left once its request ran: the answer was cut, whatever the machine's speed
    [row] = api_server.wait_usage(tenant_id, 1)
    assert (row["status"], row["finish_reason"]) == ("cancelled", "abort")
    assert row["output_tokens"] < LONG
    wait_until(api_server.engine_idle, what="all KV blocks free after the disconnect")
    _assert_settled(api_server, key)


def test_non_reading_client_is_dropped_while_others_keep_streaming(
    api_server: ApiServer, make_tenant
) -> None:
    slow_tenant, slow_key = make_tenant()
    _, fast_key = make_tenant()
    slow = _send(api_server, slow_key, _long_request(api_server, stream=True), receive_buffer=4096)
    try:  # ... and never read
        wait_until(lambda: _running(api_server), what="the slow request running")
        client = openai.OpenAI(base_url=api_server.v1, api_key=fast_key, max_retries=0)
        stream = client.completions.create(
            model=_model(api_server),
            prompt="Hello",
            max_tokens=50,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 50
        dropped = api_server.usage_rows(slow_tenant)
        assert dropped == [], "the other stream finished while the stalled client was still connected"

        [row] = api_server.wait_usage(slow_tenant, 1, deadline_s=CLIENT_TIMEOUT_S + 30)
        assert (row["status"], row["finish_reason"]) == ("cancelled", "client_timeout")
        assert 0 < row["output_tokens"] <= LONG
        assert api_server.admin("engine")["api"]["clients_dropped_slow"] >= 1
        wait_until(api_server.engine_idle, what="all KV blocks free after the drop")
        # The server closed the connection: reading what it had sent ends (EOF, or a reset).
        slow.settimeout(CLOSED_WITHIN_S)
        try:
            while slow.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail(f"the server left the dropped client's connection open for {CLOSED_WITHIN_S}s")
    finally:
        slow.close()


async def test_disconnect_storm_leaves_no_block_reservation_or_record_behind(
    api_server: ApiServer, make_tenant
) -> None:
    storm = 20
    tenant_id, key = make_tenant(max_concurrency=storm, ttft_target_s=120)
    body = _long_request(api_server, stream=True)
    headers = {"Authorization": f"Bearer {key}"}

    async def leave_early(http: httpx.AsyncClient, after_chunks: int) -> None:
        async with http.stream(
            "POST", f"{api_server.v1}/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: {")
                if seen >= after_chunks:
                    return

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=storm)) as http:
        await asyncio.gather(*(leave_early(http, 1 + i % 4) for i in range(storm)))
    wait_until(api_server.engine_idle, what="all KV blocks free after the storm")
    rows = api_server.wait_usage(tenant_id, storm)
    assert len(rows) == storm and {r["status"] for r in rows} == {"cancelled"}
    assert all(0 < r["output_tokens"] < LONG for r in rows)
    tenant = next(t for t in api_server.admin("tenants")["tenants"] if t["id"] == tenant_id)
    assert tenant["active_requests"] == 0
    client = openai.AsyncOpenAI(base_url=api_server.v1, api_key=key, max_retries=0)
    replies = await asyncio.gather(
        *(client.completions.create(model=body["model"], prompt="x", max_tokens=2) for _ in range(storm))
    )  # every concurrency slot came back: all pass at once
    assert [r.usage.completion_tokens for r in replies] == [2] * storm
