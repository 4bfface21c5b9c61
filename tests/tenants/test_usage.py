"""The usage ledger never loses an event and never counts one twice: across a PostgreSQL outage and
across the death of the writing process. Spill files are private, and what is read back from them is
checked: a bad record is set aside, never written, and never holds up the good ones. A flood of
refusals is bounded in memory and never written to disk on the caller's turn."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import pwd
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from tenants.db import create_engine, upgrade_to_head
from tenants.usage import QUARANTINE_FILE, REJECTED_FILE, UsageEvent, UsageWriter
from tests.fixtures.database import embedded_test_server

ROOT = Path(__file__).resolve().parents[2]
START = datetime(2026, 5, 1, tzinfo=UTC)
UNREACHABLE = "postgresql+asyncpg://postgres@/postgres?host=/nonexistent-weir-socket-dir&port=5432"


def make_event(n: int, tenant_id: int = 1) -> UsageEvent:
    finished = START + timedelta(seconds=n)
    return UsageEvent(
        request_id=f"req-{n:06d}",
        tenant_id=tenant_id,
        key_id=7,
        model="smol",
        prompt_tokens=n % 50,
        cached_tokens=0,
        output_tokens=n % 7,
        cost=float(n % 50 + 2 * (n % 7)),
        status="ok",
        finish_reason="stop",
        queue_s=0.001,
        ttft_s=0.05,
        tpot_s=0.01,
        e2e_s=0.2,
        started_at=finished - timedelta(seconds=0.2),
        finished_at=finished,
    )


async def _ids(engine) -> list[str]:
    async with engine.connect() as conn:
        return list((await conn.execute(sa.text("SELECT request_id FROM usage_events"))).scalars())


async def _wait_for(predicate: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not await _value(predicate()):
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _value(result: bool | Awaitable[bool]) -> bool:
    return await result if inspect.isawaitable(result) else bool(result)


@pytest.fixture
def own_server():
    """A PostgreSQL of this test's own, so that stopping it disturbs nobody else."""
    with embedded_test_server() as (server, url):
        upgrade_to_head(url)
        yield server, url


async def test_ledger_survives_a_database_outage_exactly_once(own_server, tmp_path):
    server, url = own_server
    engine = create_engine(url)
    writer = UsageWriter(
        engine, spill_dir=tmp_path / "spill", batch_size=20, flush_interval_s=0.01, retry_interval_s=0.05
    )
    for n in range(100):
        writer.submit(make_event(n))
    await writer.flush()
    assert len(await _ids(engine)) == 100

    # keep writing while the server stops, until the writer has met the outage, and a while after
    stopping = asyncio.create_task(asyncio.to_thread(server.stop))
    total = 100
    deadline = asyncio.get_running_loop().time() + 30
    while not stopping.done() or writer.database_reachable or total < 600:
        writer.submit(make_event(total))
        total += 1
        assert asyncio.get_running_loop().time() < deadline, "the writer never noticed the outage"
        await asyncio.sleep(0.001)
    await stopping
    await writer.flush()
    assert writer.pending == 0
    assert any((tmp_path / "spill").glob("*.jsonl")), "events during the outage should be spilled"
    for n in range(50):  # submitted twice: counted once
        writer.submit(make_event(n))
    await asyncio.to_thread(server.start)

    async def all_written() -> bool:
        return len(await _ids(engine)) >= total and writer.database_reachable

    await _wait_for(all_written, "replay after the restart")
    await writer.close()
    ids = await _ids(engine)
    assert sorted(ids) == [make_event(n).request_id for n in range(total)]
    assert not list((tmp_path / "spill").glob("*.jsonl"))
    await engine.dispose()


async def test_spilled_events_of_a_killed_writer_are_replayed_once(db_engine, database_url, tmp_path):
    spill = tmp_path / "spill"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = Path(__file__).with_name("usage_worker.py")
    worker = subprocess.Popen(
        [sys.executable, str(script), UNREACHABLE, str(spill), "0", "300"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = worker.stdout.readline().split()
        assert line == ["flushed", "0"], (line, worker.stderr.read() if worker.poll() is not None else "")
    finally:
        worker.kill()
        worker.wait()
    assert list(spill.glob("*.jsonl"))

    writer = UsageWriter(db_engine, spill_dir=spill, flush_interval_s=0.01, retry_interval_s=0.05)
    writer.submit(make_event(5))  # already in the spill file too
    for n in range(300, 310):
        writer.submit(make_event(n))

    async def replayed() -> bool:
        return len(await _ids(db_engine)) >= 310

    await _wait_for(replayed, "the spill file to be replayed")
    await writer.close()
    assert sorted(await _ids(db_engine)) == [make_event(n).request_id for n in range(310)]
    assert not list(spill.glob("*.jsonl"))
    # a second writer finds nothing left to replay
    again = UsageWriter(db_engine, spill_dir=spill)
    assert await again.replay_spill() == 0
    await again.close()


async def test_a_flood_of_refusals_is_bounded_and_never_spilled_on_the_callers_turn(db_engine, tmp_path):
    """Past ``max_sheds`` waiting, refusals are dropped and counted, not spilled (a write and an fsync
    each, on the event loop); they take no room from usage events, which are all kept."""
    spill = tmp_path / "spill"
    writer = UsageWriter(db_engine, spill_dir=spill, max_buffer=100, max_sheds=50, flush_interval_s=0.01)
    for n in range(1_000):  # no await in between: the background writer cannot drain anything meanwhile
        writer.record_shed(1 + n % 3, "rate")
    for n in range(100):
        writer.submit(make_event(n))
    assert not spill.exists() or not list(spill.iterdir()), "nothing may be spilled on the caller's turn"
    assert (writer.pending, writer.sheds_dropped) == (150, 950)

    await writer.flush()
    writer.record_shed(1, "kv")  # room again once the waiting ones are written
    await writer.close()
    assert writer.sheds_dropped == 950
    assert sorted(await _ids(db_engine)) == [make_event(n).request_id for n in range(100)]
    async with db_engine.connect() as conn:
        reasons = (await conn.execute(sa.text("SELECT reason FROM shed_events"))).scalars().all()
    assert sorted(reasons) == ["kv"] + ["rate"] * 50


def test_bad_events_are_refused_at_once():
    with pytest.raises(ValueError):
        make_event(1).__class__(**{**make_event(1).__dict__, "output_tokens": -1})
    with pytest.raises(ValueError):
        make_event(1).__class__(**{**make_event(1).__dict__, "started_at": datetime(2026, 1, 1)})
    writer = UsageWriter(create_engine("postgresql://postgres@/x?host=/nonexistent"))
    with pytest.raises(ValueError):
        writer.record_shed(1, "boredom")


async def test_a_value_the_database_refuses_cannot_block_the_ledger(db_engine, tmp_path):
    poisoned = make_event(1)
    object.__setattr__(poisoned, "model", "bad\x00model")  # gets past validation only by force
    writer = UsageWriter(db_engine, spill_dir=tmp_path / "spill", flush_interval_s=0.01)
    writer.submit(make_event(0))
    writer.submit(poisoned)
    writer.submit(make_event(2))
    await writer.flush()
    assert writer.database_reachable
    writer.submit(make_event(3))
    await writer.close()
    assert sorted(await _ids(db_engine)) == [make_event(n).request_id for n in (0, 2, 3)]
    rejected = (tmp_path / "spill" / REJECTED_FILE).read_text().splitlines()
    assert len(rejected) == 1 and poisoned.request_id in rejected[0]
    assert _mode(tmp_path / "spill" / REJECTED_FILE) == 0o600
    assert not list((tmp_path / "spill").glob("*.jsonl"))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def test_spill_files_are_private(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o755)  # as an older Weir left it
    spill.chmod(0o755)
    engine = create_engine(UNREACHABLE)
    writer = UsageWriter(engine, spill_dir=spill, flush_interval_s=0.01, retry_interval_s=0.05)
    for n in range(10):
        writer.submit(make_event(n))
    await writer.flush()
    await writer.close()
    await engine.dispose()
    files = list(spill.iterdir())
    assert files and _mode(spill) == 0o700
    assert {path.name.endswith(".jsonl") and _mode(path) for path in files} == {0o600}
    assert sum(len(path.read_text().splitlines()) for path in files) == 10


def _record(event: UsageEvent, **changes: object) -> dict:
    """The spill file's record of ``event`` (its format: one JSON object a line), with ``changes``."""
    record = {**asdict(event), "kind": "usage", **changes}
    for name in ("started_at", "finished_at"):
        if isinstance(record[name], datetime):
            record[name] = record[name].isoformat()
    if isinstance(record["cost"], Decimal):
        record["cost"] = str(record["cost"])
    return record


def _line(record: object) -> bytes:
    return json.dumps(record).encode() + b"\n"


async def test_bad_spilled_records_are_set_aside_and_the_good_ones_written(db_engine, tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir(mode=0o700)
    shed = {"kind": "shed", "tenant_id": 1, "reason": "rate", "at": START.isoformat(), "event_id": "a" * 32}
    without_model = _record(make_event(0))
    del without_model["model"]
    bad = [
        b"not json\n",
        b"\xff\xfe not utf-8\n",
        _line([1, 2, 3]),
        _line(_record(make_event(10), kind="bill")),
        _line(without_model),
        _line(_record(make_event(11), extra=1)),
        _line(_record(make_event(12), tenant_id="1")),
        _line(_record(make_event(13), key_id=True)),
        _line(_record(make_event(14), output_tokens=-1)),
        _line(_record(make_event(15), prompt_tokens=2**31)),
        _line(_record(make_event(16), cost=float("nan"))),
        _line(_record(make_event(23), cost="twelve")),
        _line(_record(make_event(24), cost="-1")),
        _line(_record(make_event(17), request_id="req 17; DROP TABLE usage_events")),
        _line(_record(make_event(18), request_id="")),
        _line(_record(make_event(19), model="m" * 257)),
        _line(_record(make_event(20), started_at="2026-05-01T00:00:00")),  # no time zone
        _line(_record(make_event(21), finished_at=1746057600)),
        _line({**shed, "event_id": "x"}),
        _line({**shed, "reason": "boredom"}),
        _line({**shed, "at": None}),
        b"[" * 100_000 + b"\n",
    ]
    torn = _line(_record(make_event(22)))[:-1]
    good = [_line(_record(make_event(n))) for n in (1, 2)] + [_line(shed)]
    good.insert(2, _line(_record(make_event(3), cost=float(make_event(3).cost))))  # as files held it before
    lines = [good[0], *bad[:9], good[1], *bad[9:], good[2], good[3], torn]
    (spill / "usage-older-1.jsonl").write_bytes(b"".join(lines))

    writer = UsageWriter(db_engine, spill_dir=spill, flush_interval_s=0.01, retry_interval_s=0.05)
    writer.submit(make_event(4))  # starts the writer, which replays what it finds first

    async def written() -> bool:
        return len(await _ids(db_engine)) >= 4

    await _wait_for(written, "the good events to be written")
    await writer.close()
    assert sorted(await _ids(db_engine)) == [make_event(n).request_id for n in (1, 2, 3, 4)]
    async with db_engine.connect() as conn:
        assert (await conn.execute(sa.text("SELECT event_id FROM shed_events"))).scalars().all() == ["a" * 32]
    assert not list(spill.glob("*.jsonl"))
    assert (spill / QUARANTINE_FILE).read_bytes() == b"".join([*bad, torn + b"\n"])
    assert _mode(spill / QUARANTINE_FILE) == 0o600


def _owned_by_nobody(path: Path) -> None:
    path.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)


def _linked(path: Path) -> None:
    target = path.with_name("elsewhere")
    target.mkdir(mode=0o700)
    path.symlink_to(target)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(
            _owned_by_nobody,
            id="another-users",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away"),
        ),
        pytest.param(_linked, id="a-link"),
    ],
)
async def test_a_spill_directory_that_is_not_ours_is_not_used(plant, tmp_path):
    spill = tmp_path / "spill"
    plant(spill)
    engine = create_engine(UNREACHABLE)
    writer = UsageWriter(engine, spill_dir=spill, flush_interval_s=0.01, retry_interval_s=0.05)
    writer.submit(make_event(0))
    await _wait_for(lambda: not writer.database_reachable, "the writer to meet the outage")
    await writer.close(timeout_s=0.1)
    await engine.dispose()
    assert not list(spill.resolve().iterdir())
    assert _mode(spill.resolve()) == 0o700
