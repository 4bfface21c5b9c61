"""Fair shedding under overload: FCFS and fair share side by side, through HTTP, from three tenants.

    weir bench overload [--quick] [--out FILE.json] [--model PATH] [--dtype D]
    weir bench overload --base-url fair=URL --base-url fcfs=URL --keys FILE [--quick] [--out FILE.json]

By default the benchmark makes a database (``DATABASE_URL``, else a throwaway embedded PostgreSQL), three
tenants of weight 1 with the TTFT and TPOT targets given here and a key each, then runs ``weir serve
--policy fair`` and afterwards ``weir serve --policy fcfs`` on it, each on a free port. With ``--base-url``
it uses running servers instead (one per policy, labelled ``POLICY=URL``), with the first three keys of
``--keys`` (tenants whose targets should be the ones given here).

On the first server it measures the capacity (``bench.overload_load.measure_capacity``: the request rate at
which TTFT p99 stays within the target with nothing refused); then on every server, in the same run, the
loads of ``bench.overload_load.LOADS``: Poisson streams at 1x, 2x and 3x each tenant's share of that
capacity, and ``noisy`` (one tenant at 5x its share, two light ones at 0.8 of theirs), each for
``--seconds`` (``noisy`` twice as long). Per tenant and load: goodput, SLO attainment of admitted requests,
share refused, TTFT and TPOT percentiles, refusals by status and error code (and by the server's reason
when the benchmark runs the server), and the p99 latency of refusals.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.http_load import run_load
from bench.overload_load import (
    LOADS,
    TENANTS,
    Slo,
    measure_capacity,
    refusal_latency_p99_ms,
    tenant_figures,
    tenant_load,
)
from bench.report import format_table, progress, publish
from bench.targets import Target, read_keys
from bench.weir_process import ServerError, WeirProcess, weir_serve

POLICIES = ("fair", "fcfs")
QUICK_SECONDS, FULL_SECONDS = 15.0, 40.0
FLUSH_WAIT_S = 1.0  # the server writes refusals to its database at least this often


@dataclass(frozen=True)
class Server:
    """One server under test: the policy it runs, its OpenAI base URL, and the process when it is ours."""

    policy: str
    base_url: str
    process: WeirProcess | None = None


async def server_refusals(server: Server, names: dict[str, str]) -> dict[str, Counter]:
    """The refusals the server recorded per tenant (by its reason), for the tenants named in ``names``
    (server tenant name -> label); empty when the server is not ours."""
    if server.process is None:
        return {}
    await asyncio.sleep(FLUSH_WAIT_S)
    async with httpx.AsyncClient(timeout=30) as client:
        url = f"{server.process.base_url}/admin/api/tenants"
        response = await client.get(url, headers=server.process.admin_headers)
    response.raise_for_status()
    return {names[t["name"]]: Counter(t["refused"]) for t in response.json()["tenants"] if t["name"] in names}


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.ttft_target_ms / 1000, args.tpot_target_ms / 1000)


async def run_loads(
    server: Server,
    model: str,
    keys: list[str | None],
    tokenizer,
    capacity: float,
    args: argparse.Namespace,
    names: dict[str, str],
) -> dict[str, dict]:
    """Every load of ``LOADS`` against the server, one after the other; each load's figures."""
    slo = slo_of(args)
    results = {}
    for index, (name, shape) in enumerate(LOADS.items(), start=1):
        rates = [capacity / len(TENANTS) * m for m in shape.multiples]
        seconds = args.seconds * shape.length
        load = tenant_load(tokenizer, keys, rates, seconds, args.seed, 100 + index)
        progress(f"{server.policy} {name}: {len(load)} requests at {sum(rates):.3f} req/s")
        before = await server_refusals(server, names)
        records = await run_load(server.base_url, model, load)
        after = await server_refusals(server, names)
        tenants = {}
        for label, key, multiple in zip(TENANTS, keys, shape.multiples, strict=True):
            mine = [r for r, request in zip(records, load, strict=True) if request.api_key == key]
            tenants[label] = tenant_figures(mine, slo, seconds, light=multiple < 1)
            if after:
                tenants[label]["refusal_reasons"] = dict(sorted((after[label] - before[label]).items()))
        results[name] = {
            "refusal_latency_p99_ms": refusal_latency_p99_ms(records),
            "rate_rps": round(sum(rates), 4),
            "seconds": seconds,
            "tenants": tenants,
        }
    return results


async def run_policy(
    server: Server,
    keys: list[str | None],
    tokenizer,
    args: argparse.Namespace,
    names: dict[str, str],
    capacity: dict | None,
) -> tuple[dict, dict]:
    """The capacity (measured on this server unless given) and the loads' figures on it."""
    model = await Target(server.policy, server.base_url, tuple(keys)).ready_model("overload")
    if capacity is None:
        capacity = await measure_capacity(
            server.base_url, model, keys, tokenizer, slo_of(args), args.seconds, args.seed, progress
        )
        progress(f"capacity {capacity['capacity_rps']} req/s")
    return capacity, await run_loads(server, model, keys, tokenizer, capacity["capacity_rps"], args, names)


async def create_tenants(database_url: str, slo: Slo) -> dict[str, str]:
    """Three tenants of weight 1 with the SLO's targets, under fresh names; their keys by name."""
    from sqlalchemy.pool import NullPool

    from tenants.admin import create_key, create_tenant
    from tenants.db import create_engine

    db = create_engine(database_url, poolclass=NullPool)
    tag = uuid.uuid4().hex[:8]
    keys = {}
    try:
        for label in TENANTS:
            name = f"overload-{tag}-{label}"
            tenant = await create_tenant(db, name, ttft_target_s=slo.ttft_s, tpot_target_s=slo.tpot_s)
            _, keys[name] = await create_key(db, tenant.id)
    finally:
        await db.dispose()
    return keys


def with_own_servers(args: argparse.Namespace, tokenizer, model_dir: Path) -> tuple[dict, dict]:
    """A database with the tenants, then ``weir serve --policy P`` for each policy in turn."""
    from bench.peer_server import free_port
    from bench.soak import soak_database

    capacity, loads = None, {}
    with tempfile.TemporaryDirectory(prefix="weir-overload-") as tmp, soak_database(Path(tmp)) as url:
        keys_by_name = asyncio.run(create_tenants(url, slo_of(args)))
        names = dict(zip(keys_by_name, TENANTS, strict=True))
        keys = list(keys_by_name.values())
        for policy in POLICIES:
            state = Path(tmp) / policy
            state.mkdir()
            port = free_port(0)
            progress(f"starting weir serve --policy {policy} on port {port} ({model_dir})")
            options = ("--policy", policy, "--dtype", args.dtype, "--log-level", "warning")
            try:
                with weir_serve(model_dir, port, url, state, *options) as process:
                    server = Server(policy, process.v1, process)
                    capacity, loads[policy] = asyncio.run(
                        run_policy(server, keys, tokenizer, args, names, capacity)
                    )
            except ServerError as exc:
                raise SystemExit(f"weir bench overload: error: {exc}") from None
    return capacity, loads


def with_running_servers(args: argparse.Namespace, tokenizer) -> tuple[dict, dict]:
    """The servers of ``--base-url POLICY=URL``, in the order given, with the first three ``--keys``."""
    keys = read_keys(args.keys, len(TENANTS), "overload")
    capacity, loads = None, {}
    for text in args.base_url:
        policy, _, url = text.partition("=")
        capacity, loads[policy] = asyncio.run(
            run_policy(Server(policy, url), keys, tokenizer, args, {}, capacity)
        )
    return capacity, loads


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_model_dir, load_tokenizer

    model_dir = bench_model_dir(args.model, "overload")
    tokenizer = load_tokenizer(model_dir)
    if args.base_url:
        capacity, by_policy = with_running_servers(args, tokenizer)
    else:
        capacity, by_policy = with_own_servers(args, tokenizer, model_dir)
    return {
        "benchmark": "overload",
        "capacity_rps": capacity["capacity_rps"],
        "ttft_target_ms": args.ttft_target_ms,
        "tpot_target_ms": args.tpot_target_ms,
        "seconds_per_load": args.seconds,
        "capacity": capacity,
        "loads": {load: {policy: by_policy[policy][load] for policy in by_policy} for load in LOADS},
    }


def render(result: dict) -> str:
    """A row per load, policy and tenant; then refusal latency per load and policy."""
    rows = []
    for load, by_policy in result["loads"].items():
        for policy, o in by_policy.items():
            for tenant, t in o["tenants"].items():
                rows.append(
                    [
                        load,
                        policy,
                        tenant + (" (light)" if t["light"] else ""),
                        t["requests"],
                        t["goodput_rps"],
                        _pct(t["slo_attainment"]),
                        _pct(t["refused_share"]),
                        t["ttft_p50_ms"],
                        t["ttft_p99_ms"],
                        t["tpot_p50_ms"],
                        t["tpot_p99_ms"],
                        _reasons(t),
                    ]
                )
    headers = [
        "load",
        "policy",
        "tenant",
        "requests",
        "goodput r/s",
        "SLO met % (admitted)",
        "refused %",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "refusals",
    ]
    refusals = [
        [load, policy, o["rate_rps"], o["refusal_latency_p99_ms"]]
        for load, by_policy in result["loads"].items()
        for policy, o in by_policy.items()
    ]
    return "\n".join(
        [
            f"capacity {result['capacity_rps']} req/s (TTFT p99 within {result['ttft_target_ms']:g} ms, "
            f"nothing refused); SLO: TTFT <= {result['ttft_target_ms']:g} ms, TPOT <= "
            f"{result['tpot_target_ms']:g} ms; {result['seconds_per_load']:g} s per load "
            "(noisy: twice that); latencies in ms",
            format_table(headers, rows),
            format_table(["load", "policy", "rate r/s", "refusal latency p99 ms"], refusals),
        ]
    )


def _pct(share: float | None) -> float | None:
    return None if share is None else round(100 * share, 1)


def _reasons(tenant: dict) -> str:
    """Refusals by the server's reason when known, else by status and error code."""
    counts = tenant.get("refusal_reasons", tenant["refusals"])
    return " ".join(f"{reason}:{count}" for reason, count in counts.items()) or "-"


def check_arguments(args: argparse.Namespace) -> None:
    for text in args.base_url:
        policy, sep, url = text.partition("=")
        if not sep or policy not in POLICIES or not url.startswith(("http://", "https://")):
            raise SystemExit(
                f"weir bench overload: error: --base-url takes fair=URL or fcfs=URL, got {text!r}"
            )
    if args.base_url and not args.keys:
        raise SystemExit(
            "weir bench overload: error: --base-url needs --keys FILE (three keys, one per tenant)"
        )
    if min(args.ttft_target_ms, args.tpot_target_ms, args.seconds or 1) <= 0:
        raise SystemExit("weir bench overload: error: the targets and --seconds must be positive")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else FULL_SECONDS
    publish(run(args), args.out, render)
    return 0
