"""Telemetry's cost: the same load against ``weir serve`` with telemetry off and on, in one run.

    weir bench telemetry --rounds 2 --requests 32 --rate 8

"Off" is a server with no ``OTEL_*`` variable (nothing exported; ``/metrics`` still served). "On" exports
traces and metrics by OTLP/HTTP to a receiver in this process (``bench/otlp_receiver.py``, which decodes
every payload as a collector would) and logs JSON lines. Both servers run side by side on one database;
the same seeded load goes to one server, then to the other, for ``--rounds`` rounds (one prompt set per
round, so no round finds the previous round's prompts cached; off first in even rounds, on first in odd
ones), and each mode's figures are the medians over its rounds. Alternating spreads the machine's slow
drifts over both modes. The load arrives faster than the server drains it, so output tokens/s is the
server's capacity. The server process's CPU time per output token (from ``/proc``) is shown too: on a
machine shared with other work it varies less than wall-clock figures do.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.http_load import run_load, served_model
from bench.latency import summarize
from bench.otlp_receiver import Receiver, otlp_receiver
from bench.report import format_table, progress, publish
from bench.serve import build_load
from bench.soak import soak_database
from bench.soak_ledger import create_soak_tenants
from bench.telemetry_work import cpu_us_per_request
from bench.weir_process import ServerError, weir_serve
from bench.workload import FULL, QUICK, WorkloadSpec

MODES = ("off", "on")
TARGET_PCT = 2.0  # the difference allowed in output tokens/s and in TTFT p50
WORK_REQUESTS = 2000  # requests of the in-process timing of telemetry's own work
UNBOUNDED_TTFT_S = 3600.0  # the tenants' TTFT target: nothing is shed, both modes do the same work


def _server_env(mode: str, receiver: Receiver) -> tuple[dict[str, str], tuple[str, ...]]:
    """The environment and extra ``weir serve`` options of a mode."""
    if mode == "off":
        return {}, ()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "weir-bench"}
    return env, ("--log-format", "json")


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_model_dir, load_tokenizer
    from bench.peer_server import free_port

    model_dir = bench_model_dir(args.model, "telemetry")
    tokenizer = load_tokenizer(model_dir)
    shape = QUICK if args.quick else FULL
    spec = WorkloadSpec(args.requests, shape.prompt_len, shape.output_len, seed=args.seed)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="weir-bench-telemetry-") as tmp,
        soak_database(Path(tmp)) as url,
        otlp_receiver() as receiver,
        ExitStack() as stack,
    ):
        keys = asyncio.run(create_soak_tenants(url, ttft_target_s=UNBOUNDED_TTFT_S)).keys
        progress(f"timing telemetry's own work over {WORK_REQUESTS} requests in this process")
        work_us = {"off": cpu_us_per_request(None, WORK_REQUESTS)}
        work_us["on"] = cpu_us_per_request(receiver.endpoint, WORK_REQUESTS)
        spans_before = len(receiver.snapshot())
        servers = {}
        for mode in MODES:
            env, options = _server_env(mode, receiver)
            state = Path(tmp) / mode
            state.mkdir()
            progress(f"starting weir serve with telemetry {mode}")
            options = ("--dtype", args.dtype, "--log-level", "warning", *options)
            try:
                servers[mode] = stack.enter_context(
                    weir_serve(model_dir, free_port(), url, state, *options, env=env)
                )
            except ServerError as exc:
                raise SystemExit(f"weir bench telemetry: error: {exc}") from None
        model = asyncio.run(served_model(servers["off"].v1, keys[0]))
        for round_index in range(args.rounds):
            load = build_load(tokenizer, spec, args.rate, list(keys), round_index)
            order = MODES if round_index % 2 == 0 else MODES[::-1]  # neither mode always goes first
            for mode in order:  # the idle server waits on an event: it takes no CPU from the loaded one
                progress(f"round {round_index + 1}/{args.rounds}: telemetry {mode}, {len(load)} requests")
                cpu_before = servers[mode].cpu_seconds()
                records = asyncio.run(run_load(servers[mode].v1, model, load))
                summary = summarize(records, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
                cpu = servers[mode].cpu_seconds() - cpu_before
                summary["cpu_ms_per_output_token"] = round(1000 * cpu / max(summary["output_tokens"], 1), 3)
                summary["cpu_ms_per_request"] = round(1000 * cpu / max(summary["completed"], 1), 3)
                runs[mode].append(summary)
        metric_names = sorted(receiver.metric_names)
        spans = len(receiver.snapshot()) - spans_before
    medians = {mode: _medians(runs[mode]) for mode in MODES}
    off, on = medians["off"], medians["on"]
    return {
        "benchmark": "telemetry",
        "model_dir": str(model_dir),
        "workload": {
            "requests": spec.num_requests,
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "rate_rps": args.rate,
            "seed": spec.seed,
            "rounds": args.rounds,
        },
        "runs": runs,
        "medians": medians,
        "difference_pct": {
            "output_tokens_per_s": _pct(on["output_tokens_per_s"], off["output_tokens_per_s"]),
            "ttft_p50_ms": _pct(on["ttft_p50_ms"], off["ttft_p50_ms"]),
            "cpu_ms_per_output_token": _pct(on["cpu_ms_per_output_token"], off["cpu_ms_per_output_token"]),
        },
        "otlp_metrics_received": metric_names,
        "otlp_spans_received": spans,
        "telemetry_cpu_us_per_request": {mode: round(us, 1) for mode, us in work_us.items()},
        "telemetry_share_of_request_cpu_pct": round(
            100 * (work_us["on"] - work_us["off"]) / (1000 * off["cpu_ms_per_request"]), 3
        ),
    }


def _medians(summaries: list[dict]) -> dict:
    return {
        "output_tokens_per_s": statistics.median(s["output_tokens_per_s"] for s in summaries),
        "ttft_p50_ms": statistics.median(s["ttft_ms"]["p50"] for s in summaries),
        "tpot_p50_ms": statistics.median(s["tpot_ms"]["p50"] for s in summaries),
        "cpu_ms_per_output_token": statistics.median(s["cpu_ms_per_output_token"] for s in summaries),
        "cpu_ms_per_request": statistics.median(s["cpu_ms_per_request"] for s in summaries),
        "completed": min(s["completed"] for s in summaries),
    }


def _pct(on: float, off: float) -> float:
    """How much ``on`` differs from ``off``, in percent of ``off``."""
    return round(100 * (on - off) / off, 2)


def render(result: dict) -> str:
    headers = ["round", "telemetry", "completed", "out tok/s", "TTFT p50", "TPOT p50", "CPU ms/tok"]
    rows = []
    for mode in MODES:
        for index, s in enumerate(result["runs"][mode]):
            rows.append(
                [
                    index + 1,
                    mode,
                    s["completed"],
                    s["output_tokens_per_s"],
                    s["ttft_ms"]["p50"],
                    s["tpot_ms"]["p50"],
                    s["cpu_ms_per_output_token"],
                ]
            )
    for mode in MODES:
        m = result["medians"][mode]
        figures = [m["output_tokens_per_s"], m["ttft_p50_ms"], m["tpot_p50_ms"], m["cpu_ms_per_output_token"]]
        rows.append(["median", mode, m["completed"], *figures])
    diff, work = result["difference_pct"], result["telemetry_cpu_us_per_request"]
    verdict = abs(diff["output_tokens_per_s"]) < TARGET_PCT and abs(diff["ttft_p50_ms"]) < TARGET_PCT
    return "\n".join(
        [
            "latencies in ms; 'on' exports traces and metrics by OTLP/HTTP to a local receiver",
            format_table(headers, rows),
            f"on vs off: output tokens/s {diff['output_tokens_per_s']:+.2f} %, "
            f"TTFT p50 {diff['ttft_p50_ms']:+.2f} % (target: both within {TARGET_PCT:g} %: "
            f"{'met' if verdict else 'not met'}); server CPU per output token "
            f"{diff['cpu_ms_per_output_token']:+.2f} %",
            f"received by OTLP: {result['otlp_spans_received']} spans, "
            f"{len(result['otlp_metrics_received'])} metric names",
            f"telemetry's own CPU per request (in process): off {work['off']} us, on {work['on']} us; "
            f"on adds {result['telemetry_share_of_request_cpu_pct']} % to the off server's "
            f"{result['medians']['off']['cpu_ms_per_request']} ms of CPU per request",
        ]
    )


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.requests < 1 or args.rate <= 0:
        raise SystemExit("weir bench telemetry: error: --rounds, --requests and --rate must be positive")
    publish(run(args), args.out, render)
    return 0
