"""`weir bench engine|serve|latency|stops|soak|dashboard|telemetry|fairness|overload|profile`: the
benchmarks that print comparison tables; and `weir plan`, the capacity plan from a measured profile.

The benchmark modules (torch, httpx) are imported only when a benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib
from functools import partial

from engine.config import DTYPES


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark and print its comparison table")
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    benchmarks = (
        ("engine", "offline throughput: Weir's engine vs transformers batching", add_engine_arguments),
        ("serve", "online load over HTTP: goodput, TTFT, TPOT at SLO", add_serve_arguments),
        (
            "latency",
            "TTFT by prompt length and TPOT by concurrent streams, side by side with peers",
            add_latency_arguments,
        ),
        ("stops", "stop-string matching: time per token as the output grows", add_stops_arguments),
        ("dashboard", "admin pages and the billing export on a million-row ledger", add_dashboard_arguments),
        (
            "soak",
            "a long mixed load on a weir serve of its own: RSS drift, KV blocks, ledger rows",
            add_soak_arguments,
        ),
        (
            "fairness",
            "fair share by cost: fcfs and fair policies side by side on four multi-tenant workloads",
            add_fairness_arguments,
        ),
        (
            "overload",
            "fair shedding over HTTP: fcfs and fair servers at 1x-3x capacity and with a noisy tenant",
            add_overload_arguments,
        ),
        (
            "telemetry",
            "the same load on weir serve with telemetry off and on (OTLP export): throughput and TTFT",
            add_telemetry_arguments,
        ),
        (
            "profile",
            "step times by prefill tokens, decodes and context, and the model's load time (for weir plan)",
            add_profile_arguments,
        ),
    )
    for name, help_text, add_arguments in benchmarks:
        parser = kinds.add_parser(name, help=help_text)
        add_arguments(parser)
        parser.set_defaults(func=partial(_run, _MODULES[name]))
    plan = subparsers.add_parser(
        "plan", help="replicas needed for a request mix and rate, with N+1 for failures, from a step profile"
    )
    add_plan_arguments(plan)
    plan.set_defaults(func=partial(_run, "bench.plan"))


_MODULES = {
    "engine": "bench.engine_throughput",
    "serve": "bench.serve",
    "latency": "bench.latency_bench",
    "stops": "bench.stop_matching",
    "soak": "bench.soak",
    "dashboard": "bench.dashboard",
    "fairness": "bench.fairness",
    "overload": "bench.overload",
    "telemetry": "bench.telemetry_overhead",
    "profile": "bench.step_profile",
}


def _run(module: str, args: argparse.Namespace) -> int:
    return importlib.import_module(module).main(args)


def add_dashboard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=1_000_000, help="ledger rows (default 1,000,000)")
    parser.add_argument("--days", type=int, default=30, help="days the ledger spans (default 30)")
    parser.add_argument("--tenants", type=int, default=50, help="tenants (default 50)")
    parser.add_argument("--repeat", type=int, default=20, help="timed loads of each page (default 20)")
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def add_stops_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[100, 500, 1000, 2000, 4000],
        metavar="N",
        help="output lengths to time (default 100 500 1000 2000 4000)",
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="a small workload (8 short requests) for a fast look"
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    parser.add_argument("--model", metavar="PATH", help="Hugging Face model directory (default: SmolLM2)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="workload seed (default 0)")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of every system (default auto: the one Weir measures fastest here)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run Weir once more under the torch profiler and show where time goes",
    )
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        metavar="N",
        help="run each system's workload N times (fresh prompts after the first) and report its median run",
    )


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """The servers compared: ``--base-url`` with its keys and model, each ``--peer``, the prompts' model."""
    parser.add_argument(
        "--base-url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    parser.add_argument("--name", default="weir", help="label of --base-url in the table (default weir)")
    parser.add_argument("--keys", metavar="FILE", help="API keys of --base-url, one per line")
    parser.add_argument(
        "--model-name", help="model id to request from --base-url (default: the first of GET /models)"
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=URL[@MODEL]",
        help="also run against this OpenAI-compatible server (repeatable); model id after @, else the "
        "first of its GET /models",
    )
    parser.add_argument(
        "--peer-keys",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="API keys of peer NAME, one per line (default: a dummy bearer)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="model directory whose tokenizer makes the prompts, and that transformers serve runs "
        "(default SmolLM2)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="prompt and arrival seed (default 0)"
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=[1.0],
        metavar="R",
        help="request rate(s) per second; several values sweep them in order",
    )
    parser.add_argument(
        "--requests", type=int, default=32, metavar="N", help="requests per rate (default 32)"
    )
    parser.add_argument(
        "--tenants", type=int, metavar="K", help="deal requests over the first K keys (default: all keys)"
    )
    parser.add_argument(
        "--workload",
        choices=("random", "shared-prefix"),
        default="random",
        help="random prompts (default), or multi-turn chats after one common system prompt",
    )
    parser.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=768,
        metavar="N",
        help="length of the shared-prefix workload's common system prompt (default 768)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=3,
        metavar="T",
        help="user turns per shared-prefix conversation (default 3)",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-tpot-ms", type=float, default=200)
    parser.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="share of requests within SLO below which a system misses it (default 0.9)",
    )
    parser.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also run the load against `transformers serve --continuous-batching` started here",
    )
    parser.add_argument(
        "--transformers-kv-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="KV cache of transformers serve in MiB (default 1024, the size of Weir's default)",
    )
    parser.add_argument(
        "--transformers-port", type=int, metavar="PORT", help="its port (default: a free one)"
    )
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs for a fast look")


def add_latency_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    sizes = {
        "--prompt-tokens": ([128, 512, 2048], "prompt lengths whose TTFT is measured, one request at a time"),
        "--repeats": (3, "requests per prompt length"),
        "--streams": ([1, 8, 32], "concurrent streams whose TPOT is measured"),
        "--output-tokens": (128, "max_tokens of each stream"),
        "--stream-prompt-tokens": (128, "prompt length of each stream"),
    }
    for flag, (default, text) in sizes.items():
        many = isinstance(default, list)
        shown = " ".join(map(str, default)) if many else default
        parser.add_argument(
            flag,
            type=int,
            nargs="+" if many else None,
            default=default,
            metavar="N",
            help=f"{text} (default {shown})",
        )


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=float, required=True, metavar="N", help="how long the load runs (fractions allowed)"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=0.8,
        help="request rate as a share of the measured capacity (default 0.8)",
    )
    parser.add_argument(
        "--sample-s",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between samples of RSS and the engine (default 10)",
    )
    parser.add_argument("--model", metavar="PATH", help="model directory to serve (default: SmolLM2)")
    parser.add_argument("--port", type=int, metavar="PORT", help="the server's port (default: a free one)")
    parser.add_argument(
        "--capacity-s",
        type=float,
        default=60.0,
        metavar="S",
        help="length of the closed-loop run that measures capacity (default 60)",
    )
    parser.add_argument(
        "--capacity-clients",
        type=int,
        default=8,
        metavar="N",
        help="clients of the closed-loop run (default 8)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the mix and arrivals (default 0)"
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="the server's weight and KV dtype (default auto)"
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def add_fairness_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="runs of 40 engine steps instead of 160")
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    parser.add_argument("--model", metavar="PATH", help="Hugging Face model directory (default: SmolLM2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the engine's dtype (default auto)")
    parser.add_argument(
        "--steps", type=int, metavar="N", help="engine steps per run (default 160, or 40 with --quick)"
    )
    parser.add_argument(
        "--seconds", type=float, metavar="S", help="end each run after S seconds if its steps are not done"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="workload seed (default 0)")


def add_overload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="15-second loads instead of 40-second ones")
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    parser.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="POLICY=URL",
        help="a running server of that policy (fair or fcfs; repeatable) instead of servers started here",
    )
    parser.add_argument("--keys", metavar="FILE", help="three API keys of --base-url, one per line")
    parser.add_argument("--model", metavar="PATH", help="model directory to serve (default: SmolLM2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the servers' dtype (default auto)")
    parser.add_argument("--ttft-target-ms", type=float, default=2000, help="the tenants' TTFT target")
    parser.add_argument("--tpot-target-ms", type=float, default=500, help="the tenants' TPOT target")
    parser.add_argument(
        "--seconds",
        type=float,
        metavar="S",
        help="length of each load and capacity trial (default 40, or 15 with --quick)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="prompt and arrival seed (default 0)"
    )


def add_telemetry_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=2, metavar="N", help="off/on pairs of runs (default 2)")
    parser.add_argument("--requests", type=int, default=32, metavar="N", help="requests per run (default 32)")
    parser.add_argument(
        "--rate", type=float, default=8.0, metavar="R", help="arrivals per second, above capacity (default 8)"
    )
    parser.add_argument(
        "--ttft-rate",
        type=float,
        default=1.5,
        metavar="R",
        help="arrivals per second of the load whose TTFT is compared, within capacity (default 1.5)",
    )
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs for a fast look")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000)
    parser.add_argument("--slo-tpot-ms", type=float, default=200)
    parser.add_argument("--model", metavar="PATH", help="model directory to serve (default: SmolLM2)")
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="prompt and arrival seed (default 0)"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="both servers' compute dtype (default float32: auto could choose differently for each)",
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the results as JSON")


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="Hugging Face model directory (default: SmolLM2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the engine's dtype (default auto)")
    parser.add_argument("--quick", action="store_true", help="a 3 x 3 grid and two contexts for a fast look")
    parser.add_argument("--out", metavar="FILE.json", help="also write the profile here")
    sizes = {
        "--prefill-tokens": "prefill tokens of the grid's steps, 0 included (default 0 16 64 128 256 512)",
        "--decodes": "decodes of the grid's steps, 0 included (default 0 1 4 16 64)",
        "--contexts": "context tokens of each decode; the first is the grid's (default 64 256 1024)",
    }
    for flag, text in sizes.items():
        parser.add_argument(flag, type=int, nargs="+", metavar="N", help=text)
    parser.add_argument(
        "--repeats", type=int, default=3, metavar="N", help="runs per step; the median counts"
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", metavar="FILE", help="a weir bench profile JSON (default: the cached one, else measured)"
    )
    parser.add_argument("--model", metavar="PATH", help="model directory to profile (default: SmolLM2)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="the engine's dtype (default auto)")
    parser.add_argument("--rate", type=float, default=2.0, metavar="R", help="offered requests/s (default 2)")
    lengths = "N, LOW-HIGH (uniform) or A,B,C (each equally likely)"
    parser.add_argument("--prompt-tokens", default="16-64", metavar="DIST", help=f"{lengths}; default 16-64")
    parser.add_argument("--output-tokens", default="8-16", metavar="DIST", help=f"{lengths}; default 8-16")
    parser.add_argument(
        "--ttft-ms", type=float, default=2000, metavar="T", help="TTFT p99 target (default 2000)"
    )
    parser.add_argument(
        "--tpot-ms", type=float, default=500, metavar="T", help="TPOT p99 target (default 500)"
    )
    parser.add_argument(
        "--compare-prompt-tokens",
        nargs="+",
        default=[],
        metavar="DIST",
        help="also plan each of these prompt lengths with the same outputs and rate, in a table",
    )
    parser.add_argument(
        "--failures", type=int, default=1, metavar="F", help="replica failures to survive (default 1: N+1)"
    )
    parser.add_argument(
        "--requests", type=int, default=600, metavar="N", help="requests simulated per rate (default 600)"
    )
    parser.add_argument(
        "--validate",
        action="store_true",
        help="also measure one replica's capacity on a weir serve here (weir bench overload's search)",
    )
    parser.add_argument(
        "--validate-seconds",
        type=float,
        default=40.0,
        metavar="S",
        help="length of each capacity trial of --validate (default 40)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of --validate's load (default 0)"
    )
    parser.add_argument("--out", metavar="FILE.json", help="write the plan as JSON")
