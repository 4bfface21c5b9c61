"""Online benchmark: the same seeded Poisson load, streamed over HTTP, against OpenAI-compatible servers.

    weir bench serve --base-url http://127.0.0.1:8000/v1 --keys keys.txt --tenants 3 \\
        --rate 0.25 0.5 1 --requests 32 --compare-transformers --out serve.json

Each rate runs against ``--base-url`` (named ``--name``, default ``weir``) and, with
``--compare-transformers``, against `transformers serve --continuous-batching` started here on another port
with the same model directory. The comparison rate is the lowest one at which the reference system (the
peer when there is one) meets its SLO for fewer than ``--slo-attainment`` of requests — the load where it
starts missing its SLO — or the highest rate when it never misses. Requests are greedy completions of
random real-token prompts (which do not end early) capped by ``max_tokens``; each system's output token total
and count of requests ended by EOS are reported so that equal work can be checked.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import httpx

from bench.http_load import LoadRequest, poisson_arrivals, run_load, served_model
from bench.latency import summarize
from bench.report import format_table, progress, write_json
from bench.workload import FULL, QUICK, WorkloadSpec, make_workload, ordinary_token_ids

PEER = "transformers_serve"


def read_keys(path: str | None, tenants: int | None) -> list[str | None]:
    """The first ``tenants`` keys of the file (all when None; one per line, ``#`` comments), or no key."""
    if path is None:
        if tenants is not None and tenants > 1:
            raise SystemExit(
                "weir bench serve: error: --tenants above 1 needs --keys FILE (one key per tenant)"
            )
        return [None]
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"weir bench serve: error: cannot read --keys {path}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise SystemExit(f"weir bench serve: error: --keys {path} holds no key")
    if tenants is not None and len(keys) < tenants:
        raise SystemExit(f"weir bench serve: error: --tenants {tenants} but {path} holds {len(keys)} key(s)")
    return keys[:tenants]


def prompt_text(tokenizer, ids: list[int]) -> str:
    """Text that the tokenizer encodes to (about) ``len(ids)`` tokens, made from those ids."""
    target = len(ids)
    text = tokenizer.decode(ids)
    for _ in range(3):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) <= target:
            break
        text = tokenizer.decode(encoded[:target])
    return text


def build_load(tokenizer, spec: WorkloadSpec, rate: float, keys: list[str | None]) -> list[LoadRequest]:
    """The seeded requests of ``spec`` at Poisson arrival times of ``rate``, keys dealt round-robin."""
    workload = make_workload(spec, ordinary_token_ids(tokenizer))
    arrivals = poisson_arrivals(len(workload), rate, spec.seed)
    return [
        LoadRequest(at, prompt_text(tokenizer, list(r.prompt_ids)), r.output_len, keys[i % len(keys)])
        for i, (at, r) in enumerate(zip(arrivals, workload, strict=True))
    ]


async def _bench_system(name: str, base_url: str, load: list[LoadRequest], args) -> dict:
    """Warm the server up with one short request, then run the load and summarize it."""
    try:
        model = args.model_name or await served_model(base_url, load[0].api_key)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise SystemExit(
            f"weir bench serve: error: {name} at {base_url}: cannot list models ({exc})"
        ) from None
    warm = [LoadRequest(0.0, load[0].prompt, 4, load[0].api_key)]
    await run_load(base_url, model, warm)

    def on_done(done: int, total: int) -> None:
        if done == total or done % max(1, total // 8) == 0:
            progress(f"  {name}: {done}/{total} requests ended")

    records = await run_load(base_url, model, load, on_done=on_done)
    summary = summarize(records, args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    return {"base_url": base_url, "model": model, **summary}


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

    keys = read_keys(args.keys, args.tenants)
    model_dir = bench_model_dir(args.model, "serve")
    tokenizer = load_tokenizer(model_dir)
    shape = QUICK if args.quick else FULL
    spec = WorkloadSpec(args.requests, shape.prompt_len, shape.output_len, seed=args.seed)
    targets = {args.name: args.base_url}
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        if args.compare_transformers:
            from bench.peer_server import PeerServerError, free_port, transformers_server

            log = Path(tmp) / "transformers.log"
            try:
                port = free_port(args.transformers_port or 0)
                progress(f"starting transformers serve --continuous-batching on port {port} ({model_dir})")
                with transformers_server(
                    model_dir, port, bench_device(), args.transformers_kv_mib << 20, log
                ) as url:
                    targets[PEER] = url
                    sweep = _sweep(targets, tokenizer, spec, keys, args)
            except PeerServerError as exc:
                raise SystemExit(f"weir bench serve: error: {exc}") from None
        else:
            sweep = _sweep(targets, tokenizer, spec, keys, args)
    reference = PEER if args.compare_transformers else args.name
    chosen, note = comparison_point(sweep, reference, args.slo_attainment)
    result = {
        "benchmark": "serve",
        "model_dir": str(model_dir),
        "workload": {
            "requests": spec.num_requests,
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "seed": spec.seed,
            "tenants": len(keys),
        },
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.slo_attainment},
        "comparison_rate_rps": chosen["rate_rps"],
        "comparison_note": note,
        "systems": chosen["systems"],
        "sweep": sweep,
    }
    if args.compare_transformers:
        result["goodput_ratio"] = _ratio(chosen["systems"][args.name], chosen["systems"][PEER], "goodput_rps")
    return result


def _sweep(targets: dict[str, str], tokenizer, spec: WorkloadSpec, keys, args) -> list[dict]:
    sweep = []
    for rate in args.rate:
        load = build_load(tokenizer, spec, rate, keys)
        point: dict = {"rate_rps": rate, "systems": {}}
        for name, url in targets.items():
            progress(f"rate {rate} req/s: {len(load)} requests to {name} ({url})")
            point["systems"][name] = asyncio.run(_bench_system(name, url, load, args))
        sweep.append(point)
    return sweep


def _ratio(mine: dict, theirs: dict, key: str) -> float | None:
    return round(mine[key] / theirs[key], 3) if theirs[key] else None


def render(result: dict, name: str) -> str:
    """The sweep as one table, then the comparison at the chosen rate."""
    rows = []
    for point in result["sweep"]:
        for system, s in point["systems"].items():
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
                    s["refused_total"],
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
        "refused",
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
        ratio = result["goodput_ratio"]
        shown = (
            f"{ratio:.2f}x"
            if ratio is not None
            else "unbounded (transformers serve met its SLO for no request)"
        )
        tokens = _ratio(mine, peer, "output_tokens_per_s")
        lines.append(
            f"at {rate} req/s: goodput {name} {mine['goodput_rps']} r/s vs transformers serve "
            f"{peer['goodput_rps']} r/s: {shown} (target >= 5x); output tokens/s ratio "
            + ("-" if tokens is None else f"{tokens:.2f}x")
        )
    for system, s in result["systems"].items():
        if s["refused"]:
            lines.append(f"{system} refusals at {rate} req/s by status: {s['refused']}")
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
    if not args.base_url.startswith(("http://", "https://")):
        raise SystemExit(
            f"weir bench serve: error: --base-url must start with http:// or https://, got {args.base_url!r}"
        )


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    result = run(args)
    if args.out:
        write_json(args.out, result)
        progress(f"wrote {args.out}")
    print(render(result, args.name))
    return 0


if __name__ == "__main__":
    from bench.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    add_serve_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
