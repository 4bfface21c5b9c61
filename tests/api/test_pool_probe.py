"""A ``weir engine`` on a unix socket behind ``weir serve``: it serves, and when it stops the gateway takes it
out, holds the requests that arrive meanwhile in its own queue, and probes it back in once it is restarted on
the same socket, which then serves what waited."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api.server import ApiServer, EngineServer, serving, start_engine, wait_until
from tests.api.test_fair_share import _model, _prompt, _tenant
from tests.fixtures.database import copy_of_template

ENGINE_OPTIONS = ("--max-num-seqs", "2", "--kv-cache-memory", "8", "--log-level", "warning")
PATIENT_S = 600.0  # the held request's TTFT target: it waits for the restart, never refused


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
