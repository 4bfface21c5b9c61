"""Soak benchmark: a ``weir serve`` of its own under a steady mixed load for minutes, checked for leaks.

    weir bench soak --minutes 30 [--load 0.8] [--sample-s 10] [--model PATH] [--dtype D] [--out FILE.json]

1. A database: ``DATABASE_URL`` when set, else a throwaway embedded PostgreSQL in a temporary state
   directory; two tenants without limits and one with a tiny per-minute cost limit, a key each.
2. ``weir serve`` on a free port (or ``--port``) with that database and a fresh state directory.
3. Capacity: ``--capacity-clients`` clients in a closed loop for ``--capacity-s`` seconds; completed
   requests per second.
4. Load: the mix of ``bench.soak_traffic`` at Poisson arrivals of ``--load`` x capacity for ``--minutes``,
   then the answers drained. Every ``--sample-s`` seconds, and once after the first 10 % of the load (the
   warm-up mark), the server's RSS and the engine's KV blocks and running/waiting counts are sampled.
5. End: once the engine is idle, a last sample; then the server is stopped gracefully (which flushes the
   ledger) and the ledger audited.

Checks (the exit status is 1 when one fails): RSS at the end at most ``RSS_DRIFT_TARGET_PCT`` above RSS at
the warm-up mark; every KV block free at the end; exactly one ledger row per admitted request; no request
failed (a 5xx other than a 503, an error event in a stream, a broken connection).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.http_load import served_model
from bench.report import format_table, progress, write_json
from bench.soak_ledger import (
    OVER_QUOTA_COST_PER_MINUTE,
    SoakTenants,
    audit_ledger,
    create_soak_tenants,
    spilled_request_ids,
)
from bench.soak_traffic import Mix, Outcome, Tally, Traffic, closed_loop, open_loop
from bench.weir_process import LOG_TAIL, ServerError, WeirProcess, weir_serve

WARMUP_SHARE = 0.1  # RSS drift is measured from this share of the load's duration
RSS_DRIFT_TARGET_PCT = 5.0
MAX_IN_FLIGHT = 256  # arrivals beyond this many unanswered requests are skipped (the server takes 512)
DRAIN_S = 300.0  # how long the answers may take once the load stops
IDLE_DEADLINE_S = 60.0  # how long the engine may take to go idle after the last answer
ERROR_CHARS = 160  # of each failure's message: failures are counted by this much of it


@dataclass
class Sample:
    """The server's state at one moment, and the client's counts so far."""

    t_s: int
    phase: str
    rss_mib: float
    kv_free: int
    kv_total: int
    running: int
    waiting: int
    done: int
    refused: int
    left: int


class Sampler:
    """Takes ``Sample``s of ``server``; the phase of a sample is the last one ``mark``ed before it."""

    def __init__(self, server: WeirProcess, client: httpx.AsyncClient, tally: Tally) -> None:
        self.server, self.client, self.tally = server, client, tally
        self.start = time.monotonic()
        self.marks: list[tuple[float, str]] = []
        self.samples: list[Sample] = []

    def mark(self, phase: str, delay_s: float = 0.0) -> None:
        """Samples taken ``delay_s`` from now on belong to ``phase``."""
        self.marks.append((time.monotonic() + delay_s, phase))

    def _phase(self, now: float) -> str:
        return [phase for at, phase in self.marks if at <= now][-1]

    async def take(self, phase: str | None = None) -> Sample:
        self.server.check_alive()
        stats = await self.server.engine_stats(self.client)
        now = time.monotonic()
        sample = Sample(
            round(now - self.start),
            phase or self._phase(now),
            round(self.server.rss_bytes() / 2**20, 1),
            stats["kv_blocks_free"],
            stats["kv_blocks_total"],
            stats["running"],
            stats["waiting"],
            self.tally.done,
            self.tally.refused,
            self.tally.left,
        )
        self.samples.append(sample)
        progress(
            f"[{sample.t_s:6d}s {sample.phase}] RSS {sample.rss_mib} MiB, KV free {sample.kv_free}/"
            f"{sample.kv_total}, running {sample.running}, waiting {sample.waiting}; done {sample.done}, "
            f"refused {sample.refused}, left {sample.left}, in flight {self.tally.in_flight}"
        )
        return sample

    async def every(self, seconds: float) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.take()
            except httpx.HTTPError as exc:
                progress(f"sample failed: {type(exc).__name__}: {exc}")

    async def take_after(self, delay_s: float, phase: str) -> Sample:
        await asyncio.sleep(delay_s)
        return await self.take(phase)


async def wait_idle(server: WeirProcess, client: httpx.AsyncClient, deadline_s: float) -> bool:
    """Whether nothing runs, waits or settles in the server within ``deadline_s``."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        server.check_alive()
        stats = await server.engine_stats(client)
        if (
            stats["running"] == 0
            and stats["waiting"] == 0
            and stats["api"].get("requests_in_cleanup", 0) == 0
        ):
            return True
        await asyncio.sleep(0.2)
    return False


def outcome_counts(outcomes: list[Outcome]) -> dict:
    """Requests by kind and HTTP status (``connection`` when none came), and the client's tallies."""
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[str(o.status) if o.status is not None else "connection"] += 1
    tally = Tally()
    for o in outcomes:
        tally.add(o)
    errors = Counter(o.error[:ERROR_CHARS] for o in outcomes if o.error and not o.refused)
    return {
        "requests": len(outcomes),
        "done": tally.done,
        "refused": tally.refused,
        "left": tally.left,
        "failed": tally.failed,
        "by_kind": {kind: dict(sorted(c.items())) for kind, c in sorted(by_kind.items())},
        "errors": dict(errors),
    }


async def drive(server: WeirProcess, tokenizer, tenants: SoakTenants, args: argparse.Namespace) -> dict:
    """Capacity, then the load with its samples, then the idle end state; the client's side of the soak."""
    async with httpx.AsyncClient(timeout=30) as admin:
        model = await served_model(server.v1, tenants.keys[0])
        traffic = Traffic(tokenizer, model, tenants.keys, tenants.over_quota_key, Mix(), args.seed)
        tally = Tally()
        sampler = Sampler(server, admin, tally)
        sampler.mark("capacity")
        await sampler.take()
        ticker = asyncio.create_task(sampler.every(args.sample_s))
        try:
            progress(f"capacity: {args.capacity_clients} clients in a closed loop for {args.capacity_s:g}s")
            measured, capacity = await closed_loop(
                server.v1, traffic, args.capacity_clients, args.capacity_s, tally
            )
            if capacity <= 0:
                raise SystemExit("weir bench soak: error: no request completed while measuring capacity")
            seconds = args.minutes * 60
            rate = args.load * capacity
            progress(f"capacity {capacity:.3f} req/s; load: {rate:.3f} req/s for {seconds:g}s")
            sampler.mark("load")
            sampler.mark("drain", seconds)
            warm = asyncio.create_task(sampler.take_after(seconds * WARMUP_SHARE, "warm-up"))
            outcomes, unsent = await open_loop(
                server.v1, traffic, rate, seconds, args.seed, tally, MAX_IN_FLIGHT, DRAIN_S
            )
            warm_sample = await warm
            idle = await wait_idle(server, admin, IDLE_DEADLINE_S)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        end = await sampler.take("end")
    load_samples = [s for s in sampler.samples if s.phase != "capacity"]
    return {
        "model": model,
        "capacity": {"rps": round(capacity, 4), **outcome_counts(measured)},
        "rate_rps": round(rate, 4),
        "load": {**outcome_counts(outcomes), **unsent},
        "samples": [asdict(s) for s in sampler.samples],
        "rss": rss_drift(warm_sample, end, load_samples),
        "kv": {"idle": idle, "free": end.kv_free, "total": end.kv_total},
        "admitted": [(o.request_id, o.summary) for o in measured + outcomes if o.request_id],
    }


def rss_drift(warm: Sample, end: Sample, samples: list[Sample]) -> dict:
    """RSS at the end against RSS at the warm-up mark (percent), and the largest RSS from the load on."""
    top = max(s.rss_mib for s in samples)
    return {
        "warm_mib": warm.rss_mib,
        "end_mib": end.rss_mib,
        "max_mib": top,
        "drift_pct": round(100 * (end.rss_mib - warm.rss_mib) / warm.rss_mib, 2),
        "max_drift_pct": round(100 * (top - warm.rss_mib) / warm.rss_mib, 2),
    }


def checks(result: dict) -> dict:
    """The verdict: each check's measured value, its target and whether it passed."""
    rss, kv, ledger = result["rss"], result["kv"], result["ledger"]
    mismatches = f"{ledger['missing']}/{ledger['doubled']}/{ledger['extra']}"
    failed = result["capacity"]["failed"] + result["load"]["failed"]
    return {
        "rss_drift_pct": {
            "value": rss["drift_pct"],
            "target": f"<= {RSS_DRIFT_TARGET_PCT:g}",
            "ok": rss["drift_pct"] <= RSS_DRIFT_TARGET_PCT,
        },
        "kv_blocks_free_at_end": {
            "value": f"{kv['free']}/{kv['total']}",
            "target": "all",
            "ok": kv["idle"] and kv["free"] == kv["total"],
        },
        "ledger_missing_doubled_extra": {
            "value": mismatches,
            "target": "0/0/0",
            "ok": mismatches == "0/0/0",
        },
        "requests_failed": {"value": failed, "target": "0", "ok": failed == 0},
    }


@contextlib.contextmanager
def soak_database(state_dir: Path) -> Iterator[str]:
    """``DATABASE_URL`` migrated to head, else a throwaway embedded PostgreSQL under ``state_dir``."""
    from tenants.db import DATABASE_URL_ENV, EmbeddedPostgres, async_url, upgrade_to_head

    configured = os.environ.get(DATABASE_URL_ENV)
    if configured:
        url = async_url(configured)
        upgrade_to_head(url)
        yield url
        return
    server = EmbeddedPostgres(state_dir / "postgres")
    try:
        url = server.start()
        upgrade_to_head(url)
        yield url
    finally:
        server.remove()


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_model_dir, load_tokenizer
    from bench.peer_server import PeerServerError, free_port

    model_dir = bench_model_dir(args.model, "soak")
    tokenizer = load_tokenizer(model_dir)
    try:
        port = free_port(args.port or 0)
    except PeerServerError as exc:
        raise SystemExit(f"weir bench soak: error: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="weir-soak-") as tmp, soak_database(Path(tmp)) as url:
        tenants = asyncio.run(create_soak_tenants(url))
        progress(f"starting weir serve on port {port} ({model_dir})")
        try:
            options = ("--dtype", args.dtype, "--log-level", "warning")
            with weir_serve(model_dir, port, url, Path(tmp), *options) as server:
                result = asyncio.run(drive(server, tokenizer, tenants, args))
        except ServerError as exc:
            raise SystemExit(f"weir bench soak: error: {exc}") from None
        status = server.process.returncode
        # uvicorn re-raises the SIGTERM it handled once shut down: -SIGTERM is a graceful stop
        result["server"] = {
            "exit_status": status,
            "stopped_gracefully": status in (0, -signal.SIGTERM),
            "log_tail": server.log_path.read_text(errors="replace")[-LOG_TAIL:],  # warnings and errors
        }
        spilled = spilled_request_ids(Path(tmp) / "spill")
        admitted = result.pop("admitted")
        result["ledger"] = asyncio.run(audit_ledger(url, tenants.ids, [rid for rid, _ in admitted], spilled))
        seen = dict(admitted)
        for name, ids in result["ledger"]["examples"].items():
            result["ledger"]["examples"][name] = [f"{rid} ({seen.get(rid, 'never seen')})" for rid in ids]
    result = {
        "benchmark": "soak",
        "model_dir": str(model_dir),
        "settings": {
            "minutes": args.minutes,
            "load": args.load,
            "sample_s": args.sample_s,
            "capacity_s": args.capacity_s,
            "capacity_clients": args.capacity_clients,
            "seed": args.seed,
            "dtype": args.dtype,
            "mix": asdict(Mix()),
            "over_quota_cost_per_minute": OVER_QUOTA_COST_PER_MINUTE,
        },
        **result,
    }
    result["checks"] = checks(result)
    result["passed"] = all(c["ok"] for c in result["checks"].values())
    return result


def render(result: dict) -> str:
    """The samples as a table, what the load did, then the verdict."""
    headers = ["time s", "phase", "RSS MiB", "free blocks", "running", "waiting", "done", "refused", "left"]
    rows = [
        [
            s["t_s"],
            s["phase"],
            s["rss_mib"],
            s["kv_free"],
            s["running"],
            s["waiting"],
            s["done"],
            s["refused"],
            s["left"],
        ]
        for s in result["samples"]
    ]
    load, rss, ledger = result["load"], result["rss"], result["ledger"]
    verdict = [
        [name, str(c["value"]), c["target"], "pass" if c["ok"] else "FAIL"]
        for name, c in result["checks"].items()
    ]
    return "\n".join(
        [
            f"capacity {result['capacity']['rps']} req/s (closed loop); load {result['rate_rps']} req/s "
            f"for {result['settings']['minutes']:g} min; KV blocks total {result['kv']['total']}",
            format_table(headers, rows),
            f"load: {load['requests']} requests, {load['done']} done, {load['refused']} refused, "
            f"{load['left']} left mid-stream, {load['failed']} failed, {load['skipped']} skipped, "
            f"{load['cancelled']} cancelled",
            f"by kind and HTTP status: {_by_kind(load['by_kind'])}",
            f"RSS MiB: {rss['warm_mib']} at the warm-up mark, {rss['end_mib']} at the end, "
            f"{rss['max_mib']} max ({rss['max_drift_pct']:+.2f} %)",
            f"ledger: {ledger['rows']} rows for {ledger['admitted']} admitted requests, by status "
            f"{ledger['rows_by_status']}; {ledger['spilled']} events left in the server's spill files",
            *(f"ledger {name}: {', '.join(ids)}" for name, ids in ledger["examples"].items()),
            format_table(["check", "measured", "target", "result"], verdict),
        ]
    )


def _by_kind(by_kind: dict[str, dict[str, int]]) -> str:
    return ", ".join(
        f"{kind} " + " ".join(f"{status}x{count}" for status, count in statuses.items())
        for kind, statuses in by_kind.items()
    )


def check_arguments(args: argparse.Namespace) -> None:
    for name in ("minutes", "load", "sample_s", "capacity_s"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"weir bench soak: error: --{name.replace('_', '-')} must be positive")
    if args.capacity_clients < 1:
        raise SystemExit("weir bench soak: error: --capacity-clients must be at least 1")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    result = run(args)
    print(render(result))
    if args.out:
        write_json(args.out, result)
        progress(f"wrote {args.out}")
    return 0 if result["passed"] else 1
