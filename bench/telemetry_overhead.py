"""Telemetry's cost: the same load against ``weir serve`` with telemetry off and on, in one run.

    weir bench telemetry --quick --rounds 12 --requests 16

"Off" is a server with no ``OTEL_*`` variable (nothing exported; ``/metrics`` still served). "On" exports
traces and metrics by OTLP/HTTP to a receiver in a process of its own (``bench/otlp_receiver.py``, which
decodes every payload as a collector would) and logs JSON lines. Both servers run side by side on one
database. In each round, each server in turn (off first in even rounds, on first in odd ones) gets two
seeded loads with fresh prompts (no round finds an earlier one's prompts cached): one arriving faster than
it drains (``--rate``), whose output tokens/s is the server's capacity, and one it keeps up with
(``--ttft-rate``), whose time to first token is what a client of a server within its capacity waits.
The servers start off first for the first half of the rounds, and are restarted on first for the second
half (each start is followed by one unmeasured warm-up load): with telemetry off in both, the server
started second answered 3 % slower at the median in one run, so a fixed start order would be counted
as telemetry's.

Throughput is compared round by round: each round's on/off ratio, their median and its distribution-free
95 % interval (pairing within a round cancels the machine's slow drifts). TTFT is compared on the
steady load's requests pooled over all rounds: the ratio of the two p50s, with an interval from resampling
rounds (``bench/paired_rounds.py``); one round's p50 of a few dozen requests is too coarse for a 2 %
target. The overloaded load's TTFT p50 (queueing time, which the order of arrivals within each step moves
by tens of percent) and the server process's CPU time per output token (from ``/proc``) are shown too.

Both servers run the same matrix-product kernels and pad small batches alike (``PINNED_KERNELS``, unless
this process's environment sets them): two start-up measurements can choose differently, and that
difference would be counted as telemetry's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

from bench.http_load import run_load, served_model
from bench.latency import summarize
from bench.otlp_receiver import Receiver, otlp_receiver
from bench.paired_rounds import median_interval, pooled_ratio
from bench.peer_server import free_port
from bench.report import format_table, progress, publish
from bench.serve import build_load
from bench.soak import soak_database
from bench.soak_ledger import create_soak_tenants
from bench.telemetry_work import cpu_us_per_request
from bench.weir_process import ServerError, WeirProcess, weir_serve
from bench.workload import FULL, QUICK, WorkloadSpec

MODES = ("off", "on")
TARGET_PCT = 2.0  # the difference allowed in output tokens/s and in the steady load's TTFT p50
WORK_REQUESTS = 2000  # requests of the in-process timing of telemetry's own work
UNBOUNDED_TTFT_S = 3600.0  # the tenants' TTFT target: nothing is shed, both modes do the same work
CONFIDENCE = 0.95  # of the interval around each median ratio
PINNED_KERNELS = {"WEIR_DENSE_KERNEL": "onednn", "WEIR_PACKED_WEIGHTS": "16", "WEIR_PAD_SMALL_BATCHES": "no"}
FIGURES = {  # the figures compared, each read from a run's summary
    "output_tokens_per_s": lambda s: s["output_tokens_per_s"],
    "ttft_p50_ms": lambda s: s["ttft_ms"]["p50"],
    "tpot_p50_ms": lambda s: s["tpot_ms"]["p50"],
    "cpu_ms_per_output_token": lambda s: s["cpu_ms_per_output_token"],
}


def _server_env(mode: str, receiver: Receiver) -> tuple[dict[str, str], tuple[str, ...]]:
    """The environment and extra ``weir serve`` options of a mode."""
    pinned = {name: os.environ.get(name, value) for name, value in PINNED_KERNELS.items()}
    if mode == "off":
        return pinned, ()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SERVICE_NAME": "weir-bench"}
    return pinned | env, ("--log-format", "json")


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_model_dir, load_tokenizer

    model_dir = bench_model_dir(args.model, "telemetry")
    tokenizer = load_tokenizer(model_dir)
    shape = QUICK if args.quick else FULL
    spec = WorkloadSpec(args.requests, shape.prompt_len, shape.output_len, seed=args.seed)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    kernels: dict[str, set[str]] = {mode: set() for mode in MODES}
    with (
        tempfile.TemporaryDirectory(prefix="weir-bench-telemetry-") as tmp,
        soak_database(Path(tmp)) as url,
        otlp_receiver() as receiver,
    ):
        keys = list(asyncio.run(create_soak_tenants(url, ttft_target_s=UNBOUNDED_TTFT_S)).keys)
        progress(f"timing telemetry's own work over {WORK_REQUESTS} requests in this process")
        work_us = {"off": cpu_us_per_request(None, WORK_REQUESTS)}
        work_us["on"] = cpu_us_per_request(receiver.endpoint, WORK_REQUESTS)
        spans_before = len(receiver.snapshot())
        warm_up = build_load(tokenizer, spec, args.rate, keys, args.rounds)  # a prompt set of its own
        halves = (range(args.rounds // 2), range(args.rounds // 2, args.rounds))
        for half, (start_order, rounds) in enumerate(zip((MODES, MODES[::-1]), halves, strict=True)):
            if not rounds:
                continue
            with ExitStack() as stack:
                servers = {
                    mode: _start(stack, mode, receiver, model_dir, url, Path(tmp) / f"{mode}-{half}", args)
                    for mode in start_order
                }
                model = asyncio.run(served_model(servers["off"].v1, keys[0]))
                for mode in MODES:  # first-use costs (code paths, connections, caches) out of the rounds
                    progress(f"warm-up: telemetry {mode}, {len(warm_up)} requests")
                    asyncio.run(run_load(servers[mode].v1, model, warm_up))
                for round_index in rounds:
                    loads = (
                        build_load(tokenizer, spec, args.rate, keys, round_index),
                        build_load(tokenizer, spec, args.ttft_rate, keys, args.rounds + 1 + round_index),
                    )
                    _round(servers, model, loads, round_index, args, runs)
                for mode, server in servers.items():
                    kernels[mode].add(_kernel_choice(server.log_path))
        metric_names = sorted(receiver.metric_names)
        spans = len(receiver.snapshot()) - spans_before
    medians = {mode: _medians(runs[mode]) for mode in MODES}
    return {
        "benchmark": "telemetry",
        "model_dir": str(model_dir),
        "workload": {
            "requests": spec.num_requests,
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "rate_rps": args.rate,
            "steady_rate_rps": args.ttft_rate,
            "seed": spec.seed,
            "rounds": args.rounds,
        },
        "runs": runs,
        "medians": medians,
        "ratios": {name: _ratios(runs, read) for name, read in FIGURES.items()},
        "steady_ttft": _steady_ttft(runs),
        "otlp_metrics_received": metric_names,
        "otlp_spans_received": spans,
        "kernels": {mode: "; ".join(sorted(choices)) for mode, choices in kernels.items()},
        "telemetry_cpu_us_per_request": {mode: round(us, 1) for mode, us in work_us.items()},
        "telemetry_share_of_request_cpu_pct": round(
            100 * (work_us["on"] - work_us["off"]) / (1000 * medians["off"]["cpu_ms_per_request"]), 3
        ),
    }


def _round(
    servers: dict[str, WeirProcess],
    model: str,
    loads: tuple[list, list],
    index: int,
    args: argparse.Namespace,
    runs: dict[str, list[dict]],
) -> None:
    """One round: the overloading and the steady load to each server in turn (off first in even rounds)."""
    load, steady = loads
    for mode in MODES if index % 2 == 0 else MODES[::-1]:  # the idle server takes no CPU from the loaded one
        progress(f"round {index + 1}/{args.rounds}: telemetry {mode}, {len(load)} + {len(steady)} requests")
        summary = _measure(servers[mode], model, load, args)
        summary["steady_ttft_ms"] = _ttfts_ms(servers[mode], model, steady)
        runs[mode].append(summary)


def _start(
    stack: ExitStack,
    mode: str,
    receiver: Receiver,
    model_dir: Path,
    url: str,
    state: Path,
    args: argparse.Namespace,
) -> WeirProcess:
    """Start the server of ``mode`` (stopped when ``stack`` closes)."""
    env, options = _server_env(mode, receiver)
    state.mkdir()
    progress(f"starting weir serve with telemetry {mode}")
    options = ("--dtype", args.dtype, "--log-level", "info", *options)  # on: a JSON line a request
    try:
        return stack.enter_context(weir_serve(model_dir, free_port(), url, state, *options, env=env))
    except ServerError as exc:
        raise SystemExit(f"weir bench telemetry: error: {exc}") from None


def _measure(server: WeirProcess, model: str, load: list, args: argparse.Namespace) -> dict:
    """Send ``load`` to ``server``: the run's summary, with the server's CPU time per token and request."""
    cpu_before = server.cpu_seconds()
    records = asyncio.run(run_load(server.v1, model, load))
    summary = summarize(records, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    cpu = server.cpu_seconds() - cpu_before
    summary["cpu_ms_per_output_token"] = round(1000 * cpu / max(summary["output_tokens"], 1), 3)
    summary["cpu_ms_per_request"] = round(1000 * cpu / max(summary["completed"], 1), 3)
    return summary


def _ttfts_ms(server: WeirProcess, model: str, load: list) -> list[float]:
    """Send ``load`` to ``server``: each completed request's time to first token, in ms."""
    records = asyncio.run(run_load(server.v1, model, load))
    return [round(1000 * r.ttft, 3) for r in records if r.ttft is not None]


def _steady_ttft(runs: dict[str, list[dict]]) -> dict:
    """The steady load's TTFT p50 over all rounds, on against off, with its round-resampled interval."""
    per_round = {mode: [run["steady_ttft_ms"] for run in runs[mode]] for mode in MODES}
    pooled = pooled_ratio(per_round["off"], per_round["on"], 50, CONFIDENCE)
    return {
        "p50_ms": {"off": round(pooled["base"], 2), "on": round(pooled["other"], 2)},
        "ratio": round(pooled["ratio"], 4),
        "interval": [round(bound, 4) for bound in pooled["interval"]],
        "requests": {mode: sum(map(len, per_round[mode])) for mode in MODES},
    }


def _kernel_choice(log_path: Path) -> str:
    """What the server's start-up measurement chose (dtype and matrix-product kernels), from its log."""
    found = re.search(r"chose ([^\"\n]*)", log_path.read_text(errors="replace"))
    return found.group(1) if found else "unknown"


def _medians(summaries: list[dict]) -> dict:
    medians = {name: statistics.median(read(s) for s in summaries) for name, read in FIGURES.items()}
    medians["cpu_ms_per_request"] = statistics.median(s["cpu_ms_per_request"] for s in summaries)
    medians["completed"] = min(s["completed"] for s in summaries)
    return medians


def _ratios(runs: dict[str, list[dict]], read) -> dict:
    """Each round's on/off ratio of a figure, their median and its confidence interval."""
    ratios = [read(on) / read(off) for off, on in zip(runs["off"], runs["on"], strict=True)]
    low, high = median_interval(ratios, CONFIDENCE)
    return {
        "per_round": [round(r, 4) for r in ratios],
        "median": round(statistics.median(ratios), 4),
        "interval": [round(low, 4), round(high, 4)],
    }


def _interval(ratio: dict, judged: bool = True) -> str:
    """A figure's interval in percent, and what it says of the target when ``judged``."""
    low, high = (100 * (r - 1) for r in ratio["interval"])
    bounds = f"{low:+.2f} % to {high:+.2f} %"
    if not judged:
        return f"{bounds} (not judged)"
    if low > -TARGET_PCT and high < TARGET_PCT:
        return f"{bounds}, inside the target"
    if high <= -TARGET_PCT or low >= TARGET_PCT:
        return f"{bounds}, beyond the target"
    return f"{bounds}, too wide to settle the target"


def _pct(ratio: float) -> str:
    return f"{100 * (ratio - 1):+.2f} %"


SHOWN = (
    ("output_tokens_per_s", "out tok/s"),
    ("ttft_p50_ms", "TTFT p50"),
    ("cpu_ms_per_output_token", "CPU ms/tok"),
)


def render(result: dict) -> str:
    runs, ratios, steady = result["runs"], result["ratios"], result["steady_ttft"]
    rate, steady_rate = result["workload"]["rate_rps"], result["workload"]["steady_rate_rps"]
    headers = ["round"]
    for _, label in SHOWN:
        headers += [f"{label} off", "on", "on/off"]
    headers += [f"TTFT p50 @{steady_rate:g} off", "on", "on/off"]
    rows = []
    for index, (off, on) in enumerate(zip(runs["off"], runs["on"], strict=True)):
        row: list[object] = [index + 1]
        for name, _ in SHOWN:
            row += [FIGURES[name](off), FIGURES[name](on), f"{ratios[name]['per_round'][index]:.3f}"]
        p50s = [statistics.median(run["steady_ttft_ms"]) for run in (off, on)]
        rows.append(row + [*p50s, f"{p50s[1] / p50s[0]:.3f}"])
    median: list[object] = ["median"]
    interval: list[object] = [f"{CONFIDENCE:.0%} CI"]
    for name, _ in SHOWN:
        median += [
            result["medians"]["off"][name],
            result["medians"]["on"][name],
            f"{ratios[name]['median']:.3f}",
        ]
        low, high = ratios[name]["interval"]
        interval += ["", "", f"{low:.3f}-{high:.3f}"]
    median += [steady["p50_ms"]["off"], steady["p50_ms"]["on"], f"{steady['ratio']:.3f}"]
    interval += ["", "", "{:.3f}-{:.3f}".format(*steady["interval"])]
    rows += [median, interval]
    throughput, queued, cpu = (ratios[name] for name, _ in SHOWN)
    verdict = all(abs(r - 1) < TARGET_PCT / 100 for r in (throughput["median"], steady["ratio"]))
    work = result["telemetry_cpu_us_per_request"]
    return "\n".join(
        [
            f"latencies in ms; 'on' exports traces and metrics by OTLP/HTTP to a local receiver; each round "
            f"sends {rate:g} req/s (above capacity: tokens/s, and TTFT p50 as queueing) and {steady_rate:g} "
            "req/s (within capacity: TTFT p50); on/off: that round's ratio; median row: the median of the "
            f"rounds' ratios, except TTFT p50 @{steady_rate:g}: the p50 of all rounds' requests pooled",
            format_table(headers, rows),
            f"on vs off: output tokens/s {_pct(throughput['median'])}, TTFT p50 at {steady_rate:g} req/s "
            f"{_pct(steady['ratio'])} ({steady['requests']['on']} requests; target: both within "
            f"{TARGET_PCT:g} %: {'met' if verdict else 'not met'}); TTFT p50 at {rate:g} req/s "
            f"{_pct(queued['median'])}; server CPU per output token {_pct(cpu['median'])}",
            f"{CONFIDENCE:.0%} confidence intervals: output tokens/s {_interval(throughput)}; TTFT p50 at "
            f"{steady_rate:g} req/s {_interval(steady)}; TTFT p50 at {rate:g} req/s "
            f"{_interval(queued, judged=False)}",
            "both servers chose " + result["kernels"]["off"]
            if len(set(result["kernels"].values())) == 1
            else f"the servers chose differently (the modes are not comparable): {result['kernels']}",
            f"received by OTLP: {result['otlp_spans_received']} spans, "
            f"{len(result['otlp_metrics_received'])} metric names",
            f"telemetry's own CPU per request (in process): off {work['off']} us, on {work['on']} us; "
            f"on adds {result['telemetry_share_of_request_cpu_pct']} % to the off server's "
            f"{result['medians']['off']['cpu_ms_per_request']} ms of CPU per request",
        ]
    )


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.requests < 1 or args.rate <= 0 or args.ttft_rate <= 0:
        raise SystemExit(
            "weir bench telemetry: error: --rounds, --requests, --rate and --ttft-rate must be positive"
        )
    publish(run(args), args.out, render)
    return 0
