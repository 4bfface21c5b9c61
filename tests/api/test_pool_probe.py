"""A ``weir engine`` on a unix socket behind ``weir serve``: it serves, and when it stops the gateway takes it
out, holds the requests that arrive meanwhile in its own queue, and probes it back in once it is restarted on
the same socket, which then serves what waited. A scripted engine whose probe answers cannot be read is taken
out and probed back in, and one whose deltas cannot be read fails the request, billed as far as it came."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.api.scripted_backend import (
    GENERATE,
    HEALTH,
    STATS,
    Answer,
    ScriptedBackend,
    gateway_before,
    json_answer,
    ndjson,
)
from tests.api.server import ApiServer, EngineServer, serving, start_engine, wait_until
from tests.api.test_fair_share import _model, _prompt, _tenant
from tests.fixtures.database import copy_of_template

ENGINE_OPTIONS = ("--max-num-seqs", "2", "--kv-cache-memory", "8", "--log-level", "warning")
PATIENT_S = 600.0  # the held request's TTFT target: it waits for the restart, never refused
WORD = " the"  # token 260 of the served model's tokenizer
_END = {"finished": True, "finish_reason": "stop", "prompt_tokens": 8, "output_tokens": 1}


@pytest.fixture
def pool(
    tiny_model_dir: Path, pg_server_url: str, migrated_template: str, tmp_path: Path
) -> Iterator[tuple[ApiServer, list[EngineServer]]]:
    """A gateway in front of one engine on a unix socket; the list holds the engine (restarts append)."""
    engine_state, gateway_state = tmp_path / "engine", tmp_path / "gateway"
    engine_state.mkdir()
    gateway_state.mkdir()
    engines = [start_engine(tiny_model_dir, engine_state, *ENGINE_OPTIONS, unix_socket=True)]
    try:
        engines[0].wait_ready()
        config = gateway_state / "backends.toml"
        config.write_text(f'[pool]\nprobe_interval_s = 0.2\n\n[[backends]]\nurl = "{engines[0].url}"\n')
        options = ("--backends", str(config), "--log-level", "info")
        with (
            copy_of_template(pg_server_url, migrated_template, prefix="weir_probe") as url,
            serving(tiny_model_dir, url, gateway_state, *options) as gw,
        ):
            yield gw, engines
    finally:
        engines[-1].stop()


async def test_an_engine_on_a_unix_socket_is_probed_back_in_after_a_restart(
    pool: tuple[ApiServer, list[EngineServer]], tiny_model_dir: Path
) -> None:
    gateway, engines = pool
    assert engines[0].url.startswith("unix:")
    model = _model(gateway)
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    first = await client.completions.create(model=model, prompt=_prompt(1, 16), max_tokens=4)
    assert first.usage.completion_tokens == 4

    engines[0].stop()
    log = gateway.log_path
    await asyncio.to_thread(wait_until, lambda: "taken out" in log.read_text(), 15.0, "the engine taken out")
    held = asyncio.create_task(client.completions.create(model=model, prompt=_prompt(2, 16), max_tokens=4))
    holding = lambda: gateway.admin("engine")["waiting"] == 1  # noqa: E731
    await asyncio.to_thread(wait_until, holding, 15.0, "a request held in the gateway")
    assert not held.done()

    state = engines[0].log_path.parent
    engines.append(start_engine(tiny_model_dir, state, *ENGINE_OPTIONS, unix_socket=True))
    await asyncio.to_thread(engines[-1].wait_ready)
    answer = await asyncio.wait_for(held, timeout=60)
    assert answer.usage.completion_tokens == 4
    assert "is in" in log.read_text()
    rows = gateway.wait_usage(tenant_id, 2)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert sum(r["output_tokens"] for r in rows) == 8
    wait_until(engines[-1].idle, what="the restarted engine idle with every KV block free")


@pytest.fixture(scope="module")
def scripted_pool(
    tiny_model_dir: Path, pg_server_url: str, migrated_template: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ApiServer, ScriptedBackend]]:
    """A gateway in front of a scripted ``weir engine``."""
    state = tmp_path_factory.mktemp("scripted-engine-pool")
    with (
        ScriptedBackend() as backend,
        gateway_before(
            f'url = "{backend.url}"', tiny_model_dir, pg_server_url, migrated_template, state, "info"
        ) as gateway,
    ):
        yield gateway, backend


async def test_malformed_probe_answers_fail_probes_and_probing_goes_on(
    scripted_pool: tuple[ApiServer, ScriptedBackend],
) -> None:
    """In, then three malformed answers each taking the backend out (a 200 that is not JSON, a health answer
    without its keys, stats missing fields), each followed by a good one bringing it back; a stats field
    the gateway does not know (a newer engine's) is no failure. (A probe asks /health, then /stats if that
    answered; the stats that fail are queued once the answers before them are taken, so that a probe under
    way when they are queued cannot take them out of turn.)"""
    gateway, backend = scripted_pool
    log = gateway.log_path
    ins = lambda: log.read_text().count("is in")  # noqa: E731
    assert ins() == 1
    backend.script(
        "/health", Answer(b"<html>not json</html>"), json_answer(HEALTH), json_answer({"status": "ok"})
    )
    backend.script("/stats", json_answer(STATS | {"a_newer_field": 1}))
    await asyncio.to_thread(wait_until, lambda: ins() == 3, 15.0, "the backend in after two failed probes")
    assert backend.left("/health") == backend.left("/stats") == 0
    backend.script("/stats", json_answer({"running": 0, "waiting": 0}))
    await asyncio.to_thread(wait_until, lambda: ins() == 4, 15.0, "the backend in after failed stats")
    text = log.read_text()
    assert text.count("taken out") == 3
    assert "invalid health answer: JSON is malformed" in text
    assert "invalid health answer: Object missing required field `max_model_len`" in text
    assert "invalid stats snapshot: Object missing required field" in text

    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    backend.script(GENERATE, ndjson({"text": WORD, "token_ids": [260], "output_tokens": 1}, _END))
    answer = await client.completions.create(model=_model(gateway), prompt=_prompt(3, 8), max_tokens=1)
    assert (answer.choices[0].text, answer.usage.completion_tokens) == (WORD, 1)
    (row,) = gateway.wait_usage(tenant_id, 1)
    assert (row["status"], row["output_tokens"]) == ("ok", 1)


async def test_an_engine_sending_negative_counts_fails_the_request_and_frees_the_slot(
    scripted_pool: tuple[ApiServer, ScriptedBackend],
) -> None:
    """A delta with negative counts is an answer the gateway cannot read: the stream ends with an error
    event after the token that came, billed; the backend is probed back in, and the tenant, allowed one
    request at a time, runs the next."""
    gateway, backend = scripted_pool
    tenant_id, client = _tenant(gateway, max_concurrency=1, ttft_target_s=PATIENT_S)
    negative = _END | {"prompt_tokens": -3, "output_tokens": -1}
    token = {"text": WORD, "token_ids": [260], "prompt_tokens": 8, "output_tokens": 1}
    backend.script(GENERATE, ndjson(token, negative), ndjson(token, _END))
    model = _model(gateway)
    stream = await client.completions.create(model=model, prompt=_prompt(4, 8), max_tokens=2, stream=True)
    text = ""
    with pytest.raises(openai.APIError, match="backend failed after the answer had started"):
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
    assert text == WORD
    (row,) = gateway.wait_usage(tenant_id, 1)
    assert (row["status"], row["prompt_tokens"], row["output_tokens"]) == ("error", 8, 1)
    answer = await client.completions.create(model=model, prompt=_prompt(5, 8), max_tokens=2)
    assert (answer.choices[0].text, answer.usage.completion_tokens) == (WORD, 1)
    rows = gateway.wait_usage(tenant_id, 2)
    assert sorted((r["status"], r["output_tokens"]) for r in rows) == [("error", 1), ("ok", 1)]
