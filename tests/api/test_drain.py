"""SIGTERM with requests in flight: ``weir serve`` and ``weir engine`` drain, then exit 0.

While draining, ``/readyz`` (``/health`` for the engine) answers 503 and new requests get a 503 with
``Retry-After``; admitted requests finish (or, past ``--drain-timeout``, end with an error event); every
one has exactly one ledger row billing what its client received, and the tenant's reservations and
concurrency slots are back in the database.

The drain is held open deterministically by a request whose body the client sends only later (in flight
once ``in_flight`` counts it): the checks made during the drain never race the server's exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from api import engine_wire as wire
from engine.types import SamplingParams
from tests.api.server import ApiServer, run_db, serving, start_engine, wait_until

STREAMS = 12
PATIENT = {"max_concurrency": STREAMS + 4, "ttft_target_s": 600.0}  # never shed on a busy machine
SMALL = ("--kv-cache-memory", "8")  # MiB: quick to start, room for every stream here
EXIT_DEADLINE_S = 120.0


@dataclass
class StreamResult:
    """What one client received from a streamed completion."""

    request_id: str | None = None
    first: asyncio.Event = field(default_factory=asyncio.Event)
    text_chunks: int = 0
    finish_reason: str | None = None
    usage: openai.types.CompletionUsage | None = None
    error: openai.APIError | None = None


async def _stream(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, result: StreamResult
) -> StreamResult:
    """Read a streamed completion to its end into ``result`` (an error event ends it too)."""
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            result.request_id = chunk.id
            if chunk.usage is not None:
                result.usage = chunk.usage
            for choice in chunk.choices:
                result.text_chunks += bool(choice.text)
                result.finish_reason = choice.finish_reason or result.finish_reason
            result.first.set()
    except openai.APIError as exc:
        result.error = exc
    finally:
        result.first.set()
    return result


async def _late_body(body: bytes, release: asyncio.Event) -> AsyncIterator[bytes]:
    """A request body whose second half is sent once ``release`` is set."""
    yield body[: len(body) // 2]
    await release.wait()
    yield body[len(body) // 2 :]


def _readyz(server: ApiServer) -> httpx.Response:
    return httpx.get(f"{server.base_url}/readyz", timeout=10)


def _exit_code(process: subprocess.Popen) -> int:
    return process.wait(EXIT_DEADLINE_S)


def _quota_state(server: ApiServer, tenant_id: int) -> tuple[int, float, int]:
    """The tenant's requests in flight and month's spend in ``quota_state``, and its leases left."""

    async def query(db: AsyncEngine) -> tuple[int, float, int]:
        async with db.connect() as conn:
            state = (
                await conn.execute(
                    sa.text("SELECT in_flight, period_spent FROM quota_state WHERE tenant_id = :t"),
                    {"t": tenant_id},
                )
            ).one()
            leases = await conn.scalar(
                sa.text("SELECT count(*) FROM quota_leases WHERE tenant_id = :t"), {"t": tenant_id}
            )
            return state.in_flight, state.period_spent, leases

    return run_db(server.database_url, query)


def _assert_settled(server: ApiServer, tenant_id: int, rows: list[dict]) -> None:
    """Nothing reserved or in flight is left for the tenant; what it spent is what the ledger bills."""
    in_flight, spent, leases = _quota_state(server, tenant_id)
    assert (in_flight, leases) == (0, 0)
    assert spent == pytest.approx(sum(float(r["cost"]) for r in rows))


def _assert_billed_as_received(rows: dict[str, dict], result: StreamResult) -> None:
    """The request's one ledger row bills the tokens its client was told it received."""
    row = rows[result.request_id]
    assert result.usage is not None and result.text_chunks >= 1
    assert row["output_tokens"] == result.usage.completion_tokens >= result.text_chunks
    assert row["prompt_tokens"] == result.usage.prompt_tokens
    assert float(row["cost"]) == pytest.approx(row["prompt_tokens"] + 2 * row["output_tokens"])


@pytest.fixture
def serve(tiny_model_dir: Path, database_url: str, tmp_path: Path):
    """``serve(*options)``: a fresh ``weir serve`` on this test's database (its exit is the test's)."""

    def start(*options: str):
        return serving(tiny_model_dir, database_url, tmp_path, *SMALL, "--log-level", "info", *options)

    return start


async def test_sigterm_lets_admitted_requests_finish_and_refuses_new_ones(serve) -> None:
    with serve("--drain-timeout", "300", "--body-timeout", "300") as server:
        tenant_id, key = run_db(server.database_url, server.create_tenant, **PATIENT)
        model = _readyz(server).json()["model"]
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=key, max_retries=0)
        release = asyncio.Event()
        body = json.dumps({"model": model, "prompt": "Held", "max_tokens": 8, "temperature": 0}).encode()
        async with httpx.AsyncClient(timeout=EXIT_DEADLINE_S) as http:
            held = asyncio.create_task(
                http.post(
                    f"{server.v1}/completions",
                    content=_late_body(body, release),
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
            )
            await asyncio.to_thread(
                wait_until, lambda: _readyz(server).json()["in_flight"] == 1, 60.0, "the held request in"
            )
            streams = await _start_streams(client, model, 400)
            os.kill(server.process.pid, signal.SIGTERM)
            await asyncio.to_thread(
                wait_until, lambda: _readyz(server).status_code == 503, 60.0, "/readyz to answer 503"
            )
            ready = _readyz(server).json()
            assert ready["draining"] is True and ready["ready"] is False and ready["in_flight"] >= 1
            assert httpx.get(f"{server.base_url}/healthz", timeout=10).status_code == 200
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=model, prompt="Late", max_tokens=4)
            assert refused.value.status_code == 503 and refused.value.code == "server_overloaded"
            assert int(refused.value.response.headers["retry-after"]) >= 1

            release.set()
            answer = await held
            results = await asyncio.gather(*streams)
        assert await asyncio.to_thread(_exit_code, server.process) == 0

        assert answer.status_code == 200, answer.text
        held_usage = answer.json()["usage"]
        for result in results:
            assert result.error is None, result.error
            assert result.finish_reason in ("length", "stop")
        rows = server.usage_rows(tenant_id)
        by_id = {r["request_id"]: r for r in rows}
        assert len(rows) == STREAMS + 1 and len(by_id) == STREAMS + 1
        for result in results:
            _assert_billed_as_received(by_id, result)
            assert by_id[result.request_id]["status"] == "ok"
        held_row = by_id[answer.json()["id"]]
        assert (held_row["status"], held_row["output_tokens"]) == ("ok", held_usage["completion_tokens"])
        _assert_settled(server, tenant_id, rows)


async def _start_streams(client: openai.AsyncOpenAI, model: str, max_tokens: int) -> list[asyncio.Task]:
    """``STREAMS`` streamed completions, returned once each has received its first chunk."""
    results = [StreamResult() for _ in range(STREAMS)]
    tasks = [
        asyncio.create_task(_stream(client, model, f"Story {i}: once upon a time", max_tokens, result))
        for i, result in enumerate(results)
    ]
    await asyncio.gather(*(result.first.wait() for result in results))
    return tasks


async def test_streams_still_running_at_the_drain_timeout_end_with_an_error_and_are_billed(serve) -> None:
    long = 1500  # output tokens; the tiny model rarely emits EOS
    with serve("--drain-timeout", "0") as server:
        tenant_id, key = run_db(server.database_url, server.create_tenant, **PATIENT)
        model = _readyz(server).json()["model"]
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=key, max_retries=0)
        streams = await _start_streams(client, model, long)
        os.kill(server.process.pid, signal.SIGTERM)
        results = await asyncio.gather(*streams)
        assert await asyncio.to_thread(_exit_code, server.process) == 0

    cut = [r for r in results if r.error is not None]
    assert cut, "every stream finished before the drain's cut"
    for result in cut:
        assert result.error.code == "server_shutting_down"
    rows = server.usage_rows(tenant_id)
    by_id = {r["request_id"]: r for r in rows}
    assert len(rows) == len(by_id) == STREAMS
    for result in results:
        _assert_billed_as_received(by_id, result)
        row = by_id[result.request_id]
        if result.error is None:
            assert result.finish_reason in ("length", "stop") and row["status"] == "ok"
        else:
            assert (row["status"], row["finish_reason"]) == ("cancelled", "abort")
            assert row["output_tokens"] < long
    _assert_settled(server, tenant_id, rows)


async def test_a_draining_engine_reports_it_refuses_new_requests_and_finishes_its_own(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    engine = start_engine(tiny_model_dir, tmp_path, *SMALL, "--drain-timeout", "300", "--log-level", "info")
    try:
        engine.wait_ready()
        params = SamplingParams(max_tokens=16, temperature=0)

        def request(request_id: str) -> bytes:
            return wire.encode_request(request_id, [1, 9906, 2135], params, "t", 1.0, 0, None, None)

        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=engine.url, timeout=EXIT_DEADLINE_S) as http:
            held = asyncio.create_task(
                http.post(wire.GENERATE_PATH, content=_late_body(request("held"), release))
            )
            await asyncio.to_thread(
                wait_until,
                lambda: engine.get("/health").json()["in_flight"] == 1,
                60.0,
                "the held request in",
            )
            os.kill(engine.process.pid, signal.SIGTERM)
            await asyncio.to_thread(
                wait_until, lambda: engine.get("/health").status_code == 503, 60.0, "/health to answer 503"
            )
            assert engine.get("/health").json()["status"] == "draining"
            refused = await http.post(wire.GENERATE_PATH, content=request("late"))
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            release.set()
            answer = await held
        assert await asyncio.to_thread(_exit_code, engine.process) == 0
    finally:
        engine.stop()
    assert answer.status_code == 200
    last = json.loads(answer.text.splitlines()[-1])
    assert (last["finished"], last["finish_reason"], last["output_tokens"]) == (True, "length", 16)
