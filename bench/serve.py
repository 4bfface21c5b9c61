"""Online benchmark: the same seeded Poisson load, streamed over HTTP, against OpenAI-compatible servers.

    weir bench serve --base-url http://127.0.0.1:8000/v1 --keys keys.txt --tenants 3 \\
        --rate 0.25 0.5 1 --requests 32 --peer vllm=http://127.0.0.1:8001/v1 --out serve.json

At each rate the load runs against ``--base-url`` (named ``--name``, default ``weir``), then against
`transformers serve --continuous-batching` started here with ``--compare-transformers``, then against each
``--peer``, one server after the other. Every rate draws prompts of its own (from the seed and the rate's
index), so no server's prefix cache holds a previous rate's work. The comparison rate is the lowest one at
which the reference system (the first peer when there is one) meets its SLO for fewer than
``--slo-attainment`` of requests — the load where it starts missing its SLO — or the highest rate when it
never misses. The default workload is greedy completions of random real-token prompts (which do not end
early) capped by ``max_tokens``; ``--workload shared-prefix`` is multi-turn chats after one long common
system prompt. Each system's output token total and count of requests ended by EOS are reported so that
equal work can be checked.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from bench.http_load import ChatSession, LoadRequest, poisson_arrivals, run_load
from bench.latency import summarize
from bench.report import format_ratio, format_table, progress, publish, ratio
from bench.targets import Target, comparison_targets
from bench.workload import (
    CHAT_TURNS,
    CHAT_TURNS_QUICK,
    FULL,
    QUICK,
    ChatSpec,
    WorkloadSpec,
    derived_seed,
    make_chat_workload,
    make_workload,
    ordinary_token_ids,
    prompt_text,
    redraw_prompts,
)

PEER = "transformers_serve"
SHAPES = {  # (--workload, --quick): request or turn count, prompt or user turn lengths, output lengths
    ("random", False): FULL,
    ("random", True): QUICK,
    ("shared-prefix", False): CHAT_TURNS,
    ("shared-prefix", True): CHAT_TURNS_QUICK,
}
Load = list[LoadRequest] | list[ChatSession]


def build_load(
    tokenizer, spec: WorkloadSpec, rate: float, keys: list[str | None], rate_index: int = 0
) -> list[LoadRequest]:
    """The requests of ``spec`` for rate number ``rate_index``: lengths from the spec's seed, prompt tokens
    from the seed and ``rate_index`` (so rates share no prompt prefix), Poisson arrival times of ``rate``
    (the same pattern, scaled, at every rate), keys dealt round-robin."""
    ids = ordinary_token_ids(tokenizer)
    workload = redraw_prompts(make_workload(spec, ids), ids, derived_seed(spec.seed, rate_index))
    arrivals = poisson_arrivals(len(workload), rate, spec.seed)
    return [
        LoadRequest(at, prompt_text(tokenizer, list(r.prompt_ids)), r.output_len, keys[i % len(keys)])
        for i, (at, r) in enumerate(zip(arrivals, workload, strict=True))
    ]


def build_chat_load(
    tokenizer, spec: ChatSpec, rate: float, keys: list[str | None], rate_index: int = 0
) -> list[ChatSession]:
    """The conversations of ``spec`` for rate number ``rate_index``, opened at Poisson times of ``rate``:
    one system prompt for all of them, drawn afresh (like the user turns) for each rate."""
    ids = ordinary_token_ids(tokenizer)
    workload = make_chat_workload(spec, ids, derived_seed(spec.shape.seed, rate_index))
    system = prompt_text(tokenizer, list(workload.system_ids))
    arrivals = poisson_arrivals(len(workload.conversations), rate, spec.shape.seed)
    return [
        ChatSession(
            at,
            system,
            tuple(prompt_text(tokenizer, list(turn.prompt_ids)) for turn in turns),
            tuple(turn.output_len for turn in turns),
            keys[i % len(keys)],
        )
        for i, (at, turns) in enumerate(zip(arrivals, workload.conversations, strict=True))
    ]


async def _sweep(targets: list[Target], load_at: Callable[[int, float], Load], args) -> list[dict]:
    """Each rate's load against every target in order; each peer's ratios to the first target."""
    models = {target.name: await target.ready_model("serve") for target in targets}
    sweep = []
    for index, rate in enumerate(args.rate):
        load = load_at(index, rate)
        point: dict = {"rate_rps": rate, "systems": {}}
        for target in targets:
            progress(f"rate {rate} req/s: {len(load)} {_unit(args)} to {target.name} ({target.base_url})")
            records = await run_load(
                target.base_url, models[target.name], target.deal(load), on_done=_progress(target.name)
            )
            summary = summarize(records, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
            point["systems"][target.name] = {
                "base_url": target.base_url,
                "model": models[target.name],
                **summary,
            }
        base = point["systems"][targets[0].name]
        point["ratios"] = {t.name: peer_ratios(point["systems"][t.name], base) for t in targets[1:]}
        sweep.append(point)
    return sweep


def _unit(args: argparse.Namespace) -> str:
    return "conversations" if args.workload == "shared-prefix" else "requests"


def _progress(name: str) -> Callable[[int, int], None]:
    def on_done(done: int, total: int) -> None:
        if done == total or done % max(1, total // 8) == 0:
            progress(f"  {name}: {done}/{total} requests ended")

    return on_done


def peer_ratios(peer: dict, base: dict) -> dict[str, float | None]:
    """A peer's goodput and p50 TTFT and TPOT divided by the base system's."""
    return {
        "goodput": ratio(peer["goodput_rps"], base["goodput_rps"]),
        "ttft_p50": ratio(peer["ttft_ms"]["p50"], base["ttft_ms"]["p50"]),
        "tpot_p50": ratio(peer["tpot_ms"]["p50"], base["tpot_ms"]["p50"]),
    }


def comparison_point(sweep: list[dict], reference: str, attainment: float) -> tuple[dict, str]:
    """The lowest rate at which ``reference`` meets its SLO for fewer than ``attainment`` of requests (the
    last rate when it never does), and a note on what that means for the sweep."""
    for i, point in enumerate(sweep):
        if point["systems"][reference]["slo_attainment"] < attainment:
            if i == 0:
                return point, f"{reference} misses its SLO already at the lowest rate: sweep lower rates too"
            return point, f"{reference} starts missing its SLO at {point['rate_rps']} req/s"
    return sweep[-1], f"{reference} met its SLO at every rate: sweep higher rates to find where it misses"


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_device, bench_model_dir, load_tokenizer

    targets = comparison_targets(args, "serve", args.tenants)
    model_dir = bench_model_dir(args.model, "serve")
    tokenizer = load_tokenizer(model_dir)
    chat = args.workload == "shared-prefix"
    shape = SHAPES[args.workload, args.quick]
    spec = WorkloadSpec(args.requests, shape.prompt_len, shape.output_len, seed=args.seed)
    chat_spec = ChatSpec(spec, args.system_prompt_tokens, args.turns)

    def load_at(index: int, rate: float) -> Load:
        if chat:
            return build_chat_load(tokenizer, chat_spec, rate, [None], index)
        return build_load(tokenizer, spec, rate, [None], index)

    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp, ExitStack() as servers:
        if args.compare_transformers:
            from bench.peer_server import PeerServerError, free_port, transformers_server

            try:
                port = free_port(args.transformers_port or 0)
                progress(f"starting transformers serve --continuous-batching on port {port} ({model_dir})")
                url = servers.enter_context(
                    transformers_server(
                        model_dir, port, bench_device(), args.transformers_kv_mib << 20, Path(tmp) / "tf.log"
                    )
                )
            except PeerServerError as exc:
                raise SystemExit(f"weir bench serve: error: {exc}") from None
            targets.insert(1, Target(PEER, url))
        sweep = asyncio.run(_sweep(targets, load_at, args))
    reference = targets[1].name if len(targets) > 1 else args.name
    chosen, note = comparison_point(sweep, reference, args.slo_attainment)
    workload = {
        "kind": args.workload,
        "requests": spec.num_requests,
        "prompt_len": list(spec.prompt_len),
        "output_len": list(spec.output_len),
        "seed": spec.seed,
        "tenants": len(targets[0].keys),
    }
    if chat:
        workload.update(
            conversations=spec.num_requests, system_prompt_tokens=args.system_prompt_tokens, turns=args.turns
        )
    result = {
        "benchmark": "serve",
        "model_dir": str(model_dir),
        "workload": workload,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.slo_attainment},
        "comparison_rate_rps": chosen["rate_rps"],
        "comparison_note": note,
        "systems": chosen["systems"],
        "sweep": sweep,
    }
    if args.compare_transformers:
        systems = chosen["systems"]
        result["goodput_ratio"] = ratio(systems[args.name]["goodput_rps"], systems[PEER]["goodput_rps"])
    return result


def render(result: dict, name: str) -> str:
    """The sweep as one table (each peer's goodput, TTFT and TPOT as a multiple of ``name``'s), then the
    comparison at the chosen rate."""
    rows = []
    for point in result["sweep"]:
        for system, s in point["systems"].items():
            ratios = point["ratios"].get(system, {})
            rows.append(
                [
                    point["rate_rps"],
                    system,
                    s["goodput_rps"],
                    round(100 * s["slo_attainment"], 1),
                    s["output_tokens_per_s"],
                    s["ttft_ms"]["p50"],
                    s["ttft_ms"]["p99"],
                    s["tpot_ms"]["p50"],
                    s["tpot_ms"]["p99"],
                    s["e2e_ms"]["p99"],
                    s["output_tokens"],
                    s["cached_pct"],
                    s["refused_total"],
                    *(format_ratio(ratios.get(key)) for key in ("goodput", "ttft_p50", "tpot_p50")),
                ]
            )
    headers = [
        "rate",
        "system",
        "goodput r/s",
        "SLO met %",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p99",
        "out tokens",
        "cached %",
        "refused",
        f"goodput/{name}",
        f"TTFT p50/{name}",
        f"TPOT p50/{name}",
    ]
    slo = result["slo"]
    lines = [
        f"SLO: TTFT <= {slo['ttft_ms']} ms and TPOT <= {slo['tpot_ms']} ms (latencies in ms)",
        format_table(headers, rows),
    ]
    rate = result["comparison_rate_rps"]
    lines.append(result["comparison_note"])
    if "goodput_ratio" in result:
        mine, peer = result["systems"][name], result["systems"][PEER]
        goodput = result["goodput_ratio"]
        shown = format_ratio(goodput) or "unbounded (transformers serve met its SLO for no request)"
        tokens = format_ratio(ratio(mine["output_tokens_per_s"], peer["output_tokens_per_s"]))
        lines.append(
            f"at {rate} req/s: goodput {name} {mine['goodput_rps']} r/s vs transformers serve "
            f"{peer['goodput_rps']} r/s: {shown} (target >= 5x); output tokens/s ratio {tokens or '-'}"
        )
    for system, s in result["systems"].items():
        if s["refused"]:
            lines.append(f"{system} refusals at {rate} req/s by status: {s['refused']}")
        if s["skipped"]:
            lines.append(
                f"{system}: {s['skipped']} turns at {rate} req/s not sent after an earlier turn failed"
            )
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    if args.requests < 1:
        raise SystemExit("weir bench serve: error: --requests must be at least 1")
    if args.tenants is not None and args.tenants < 1:
        raise SystemExit("weir bench serve: error: --tenants must be at least 1")
    if any(r <= 0 for r in args.rate):
        raise SystemExit("weir bench serve: error: --rate values must be positive")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0 or not 0 < args.slo_attainment <= 1:
        raise SystemExit("weir bench serve: error: SLO values must be positive (attainment in (0, 1])")
    if args.system_prompt_tokens < 1 or args.turns < 1:
        raise SystemExit("weir bench serve: error: --system-prompt-tokens and --turns must be at least 1")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    publish(run(args), args.out, lambda result: render(result, args.name))
    return 0


if __name__ == "__main__":
    from bench.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
