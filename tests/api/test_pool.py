"""A pool of two real ``weir engine`` processes behind one ``weir serve``: requests spread across both, a
prompt prefix goes back to the engine holding its blocks, a closed stream frees its blocks, fair shares
hold across the pool in front of first-come-first-served engines, and when one engine is killed mid-load
the requests it had not started move to the other, the started streams end with an error event and are
billed for what was sent, and the pool serves on."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import openai
import pytest

from tests.api.server import ApiServer, EngineServer, engines_serving, serving, wait_until
from tests.api.test_fair_share import _model, _prompt, _served, _tenant
from tests.fixtures.database import copy_of_template

ENGINE_OPTIONS = (
    "--policy",
    "fcfs",
    "--max-num-seqs",
    "2",
    "--kv-cache-memory",
    "8",
    "--log-level",
    "warning",
)
WINDOW = 300  # cost units a backend may hold: the fair order is the gateway's, not the engines'
PATIENT_S = 600.0


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineServer]]:
    states = [tmp_path_factory.mktemp(f"engine-{i}") for i in range(2)]
    with engines_serving(tiny_model_dir, states, *ENGINE_OPTIONS) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(
    engines: list[EngineServer],
    tiny_model_dir: Path,
    pg_server_url: str,
    migrated_template: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    state = tmp_path_factory.mktemp("pool-state")
    config = state / "backends.toml"
    entries = "".join(f'[[backends]]\nurl = "{engine.url}"\n\n' for engine in engines)
    config.write_text(
        f"[pool]\ninitial_window = {WINDOW}\nmax_window = {WINDOW}\nprobe_interval_s = 0.5\n\n{entries}"
    )
    options = ["--backends", str(config), "--deadline-grace", "0.2", "--log-level", "warning"]
    with (
        copy_of_template(pg_server_url, migrated_template, prefix="weir_pool") as url,
        serving(tiny_model_dir, url, state, *options) as server,
    ):
        yield server


def _all_idle(engines: list[EngineServer]) -> bool:
    return all(engine.idle() for engine in engines)


async def test_requests_spread_across_both_engines(gateway: ApiServer, engines: list[EngineServer]) -> None:
    model = _model(gateway)
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    before = [engine.stats()["steps"] for engine in engines]
    answers = await asyncio.gather(
        *(
            client.completions.create(model=model, prompt=_prompt(100 + i, 16), max_tokens=8, temperature=0)
            for i in range(12)
        )
    )
    assert [a.usage.completion_tokens for a in answers] == [8] * 12
    after = [engine.stats()["steps"] for engine in engines]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    rows = gateway.wait_usage(tenant_id, 12)
    assert {(r["status"], r["output_tokens"], r["cost"]) for r in rows} == {("ok", 8, 16 + 2 * 8)}
    wait_until(lambda: _all_idle(engines), what="both engines idle with every KV block free")


async def test_a_closed_stream_aborts_its_sequence_in_the_engine(
    gateway: ApiServer, engines: list[EngineServer]
) -> None:
    model = _model(gateway)
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    stream = await client.completions.create(
        model=model, prompt=_prompt(7, 16), max_tokens=1000, temperature=0, stream=True
    )
    received = 0
    async for chunk in stream:
        received += len(chunk.choices[0].text) > 0
        if received == 2:
            break
    await stream.close()
    (row,) = gateway.wait_usage(tenant_id, 1)
    assert row["status"] == "cancelled" and 2 <= row["output_tokens"] < 1000
    wait_until(lambda: _all_idle(engines), what="the engines to free the closed stream's blocks")


async def test_a_prompt_prefix_goes_back_to_the_engine_holding_its_blocks(
    gateway: ApiServer, engines: list[EngineServer]
) -> None:
    """Idle engines tie on outstanding cost, and a tie goes to the first: a prefix homed on the second by
    an earlier request must go back there, where its blocks are, for its prompt to be served from cache."""
    model = _model(gateway)
    _, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    first, second = engines
    shared = _prompt(4242, 64)  # four full blocks
    busy = await client.completions.create(
        model=model, prompt=_prompt(4243, 16), max_tokens=1000, temperature=0, stream=True
    )
    async for chunk in busy:
        if chunk.choices and chunk.choices[0].text:
            break
    assert first.stats()["running"] == 1  # the tie went to the first engine, which is now busy
    steps = second.stats()["steps"]
    homed = await client.completions.create(
        model=model, prompt=shared + _prompt(1, 8), max_tokens=2, temperature=0
    )
    assert homed.usage.prompt_tokens_details.cached_tokens == 0
    assert second.stats()["steps"] > steps  # the least loaded engine took the prefix
    await busy.close()
    wait_until(lambda: _all_idle(engines), what="both engines idle")

    before = [engine.stats()["steps"] for engine in engines]
    again = await client.completions.create(
        model=model, prompt=shared + _prompt(2, 8), max_tokens=2, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens == len(shared)
    assert first.stats()["steps"] == before[0]
    novel = await client.completions.create(
        model=model, prompt=_prompt(4244, 72), max_tokens=2, temperature=0
    )
    assert novel.usage.prompt_tokens_details.cached_tokens == 0
    assert first.stats()["steps"] > before[0]  # a prompt with no home goes to the first of the idle
    wait_until(lambda: _all_idle(engines), what="both engines idle")


async def test_fair_shares_hold_across_the_pool(gateway: ApiServer, engines: list[EngineServer]) -> None:
    """The engines are first come, first served: the 1:2 split is the gateway's fair queue's work."""
    model = _model(gateway)
    tenants = {weight: _tenant(gateway, weight=weight, ttft_target_s=PATIENT_S) for weight in (1.0, 2.0)}
    requests = 40

    async def complete(client: openai.AsyncOpenAI, prompt: list[int]) -> int:
        answer = await client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
        return answer.usage.completion_tokens

    jobs = [
        complete(client, _prompt(int(weight) * 1000 + i, 64))
        for i in range(requests)
        for weight, (_, client) in tenants.items()
    ]
    assert all(tokens == 32 for tokens in await asyncio.gather(*jobs))
    rows = {w: gateway.wait_usage(tenant_id, requests) for w, (tenant_id, _) in tenants.items()}
    # The window in which both tenants had requests waiting for their turn: from the later one's first
    # arrival to the start of the first one's last request (after it, the other's requests fill the
    # window of outstanding work while the last ones of the first still run).
    since = max(min(r["started_at"] for r in rs) for rs in rows.values())
    until = min(max(r["started_at"] + timedelta(seconds=r["ttft_s"]) for r in rs) for rs in rows.values())
    assert (until - since).total_seconds() > 0
    light, heavy = (_served(rows[w], since, until) for w in (1.0, 2.0))
    assert heavy / light == pytest.approx(2.0, rel=0.15)
    wait_until(lambda: _all_idle(engines), what="both engines idle after the backlog")


async def test_an_engine_killed_mid_load(gateway: ApiServer, engines: list[EngineServer]) -> None:
    """Each engine runs two of these requests; as they progress the window lets a third wait in its queue."""
    model = _model(gateway)
    tenant_id, client = _tenant(gateway, ttft_target_s=PATIENT_S)
    survivor, victim = engines
    max_tokens = 64
    received = [0] * 10

    async def stream_one(i: int) -> tuple[int, str | None]:
        try:
            stream = await client.completions.create(
                model=model, prompt=_prompt(300 + i, 16), max_tokens=max_tokens, temperature=0, stream=True
            )
            async for chunk in stream:
                received[i] += bool(chunk.choices and chunk.choices[0].text)
        except openai.APIError as exc:
            return received[i], str(exc)
        return received[i], None

    tasks = [asyncio.create_task(stream_one(i)) for i in range(10)]

    def loaded() -> bool:
        """Four streams under way (two on each engine) and one more waiting in the victim's queue."""
        if sum(n > 0 for n in received) < 4:
            return False
        stats = victim.stats()
        return stats["running"] == 2 and stats["waiting"] >= 1

    await asyncio.to_thread(wait_until, loaded, 60.0, "the victim engine running two requests, one waiting")
    os.kill(victim.process.pid, signal.SIGKILL)
    results = await asyncio.gather(*tasks)

    failed = [(chunks, error) for chunks, error in results if error is not None]
    assert 1 <= len(failed) <= 2, results  # what the victim was running; its waiting one moved
    assert all(chunks >= 1 for chunks, _ in failed)
    assert all("backend failed after the answer had started" in error for _, error in failed)
    rows = gateway.wait_usage(tenant_id, 10)
    errors = [r for r in rows if r["status"] == "error"]
    assert len(errors) == len(failed)
    for row in errors:  # billed for what was sent: the tokens streamed before the engine died
        assert 1 <= row["output_tokens"] < max_tokens
        assert float(row["cost"]) == row["prompt_tokens"] + 2 * row["output_tokens"]
    assert sorted(chunks for chunks, _ in failed) <= sorted(r["output_tokens"] for r in errors)
    assert [r["output_tokens"] for r in rows if r["status"] == "ok"] == [max_tokens] * (10 - len(failed))
    assert "moves to another backend" in gateway.log_path.read_text()

    answer = await client.completions.create(
        model=model, prompt=_prompt(999, 16), max_tokens=4, temperature=0
    )
    assert answer.usage.completion_tokens == 4
    assert gateway.admin("engine")["waiting"] == 0
    wait_until(survivor.idle, what="the survivor idle with every KV block free")
