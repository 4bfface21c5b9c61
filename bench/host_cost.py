"""The CPU a serving process spends outside its engine, per request and per output token: the host work that
`weir plan` adds to a profile's engine step times (``engine.capacity_plan.HostCost``).

It starts a database with the overload benchmark's tenants and a `weir serve` of the model, then sends
streamed completions of the overload mix one at a time: ``REQUESTS`` with one output token, then as many
with ``LONG_OUTPUT``. The server's host work is the CPU time of its main thread, the event loop (HTTP, auth,
tokenizing, the quota reservation, SSE events, settlement; the engine's own threads are not counted); the
load generator's is this process's CPU time over the same requests. Each is fitted as ``request_s +
token_s * output tokens`` through the two groups' means.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.http_load import stream_completion, streamed_body
from bench.overload_load import Slo, tenant_load
from bench.report import progress

REQUESTS = 24  # per group
LONG_OUTPUT = 48  # output tokens asked of the second group
SEED = 7


def _fit(short: tuple[float, float], long: tuple[float, float], cores: int) -> dict:
    """``request_s`` and ``token_s`` through two groups' (mean output tokens, mean CPU seconds), neither
    below zero."""
    (tokens_a, cpu_a), (tokens_b, cpu_b) = short, long
    token_s = max(0.0, (cpu_b - cpu_a) / (tokens_b - tokens_a)) if tokens_b > tokens_a else 0.0
    request_s = max(0.0, cpu_a - token_s * tokens_a)
    return {"cores": cores, "request_s": round(request_s, 6), "token_s": round(token_s, 6)}


async def _groups(process, key: str, tokenizer) -> dict[str, list[tuple[float, float, float]]]:
    """Per group, one (output tokens, server main-thread CPU, this process's CPU) per request."""
    from bench.targets import Target

    model = await Target("host", process.v1, (key,)).ready_model("profile")
    load = tenant_load(tokenizer, [key], [1.0], REQUESTS, SEED, 0)
    groups: dict[str, list[tuple[float, float, float]]] = {"short": [], "long": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
        for name, max_tokens in (("short", 1), ("long", LONG_OUTPUT)):
            for request in load:
                body = streamed_body(model, {"prompt": request.prompt, "max_tokens": max_tokens})
                server, here = process.main_thread_cpu_seconds(), time.process_time()
                record = await stream_completion(client, process.v1 + "/completions", body, key)
                if not record.ok:
                    raise SystemExit(f"weir bench profile: error: a request failed: {record.error}")
                groups[name].append(
                    (
                        record.output_tokens,
                        process.main_thread_cpu_seconds() - server,
                        time.process_time() - here,
                    )
                )
    return groups


def measure_host_cost(model_dir: Path, dtype: str) -> dict:
    """The server's and the load generator's host work (``HostCost`` fields) on a `weir serve` here."""
    from bench.model import load_tokenizer
    from bench.overload import create_tenants
    from bench.peer_server import free_port
    from bench.soak import soak_database
    from bench.weir_process import ServerError, weir_serve

    tokenizer = load_tokenizer(model_dir)
    progress("measuring the host work per request on a weir serve")
    with tempfile.TemporaryDirectory(prefix="weir-host-") as tmp, soak_database(Path(tmp)) as db_url:
        key = next(iter(asyncio.run(create_tenants(db_url, Slo(60.0, 10.0))).values()))
        options = ("--dtype", dtype, "--log-level", "warning")
        try:
            with weir_serve(model_dir, free_port(0), db_url, Path(tmp), *options) as process:
                groups = asyncio.run(_groups(process, key, tokenizer))
        except ServerError as exc:
            raise SystemExit(f"weir bench profile: error: {exc}") from None
    means = {
        name: [sum(column) / len(rows) for column in zip(*rows, strict=True)] for name, rows in groups.items()
    }
    cores = len(os.sched_getaffinity(0))  # the cores this process, and the server it started, may run on
    short, long = means["short"], means["long"]
    host = {
        "server": _fit((short[0], short[1]), (long[0], long[1]), cores),
        "client": _fit((short[0], short[2]), (long[0], long[2]), cores),
        "requests": sum(len(rows) for rows in groups.values()),
        "measured": "CPU of weir serve's event-loop thread and of the load generator, per streamed request "
        "sent one at a time, fitted over output tokens",
    }
    server, client = host["server"], host["client"]
    progress(
        f"host work: server {server['request_s'] * 1e3:.2f} ms a request + {server['token_s'] * 1e3:.3f} ms "
        f"a token, load generator {client['request_s'] * 1e3:.2f} ms + {client['token_s'] * 1e3:.3f} ms"
    )
    return host
