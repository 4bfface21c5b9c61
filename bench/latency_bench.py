"""Latency benchmark: TTFT by prompt length and TPOT by concurrent streams, side by side with peers.

    weir bench latency --base-url http://127.0.0.1:8000/v1 --keys keys.txt \\
        --peer vllm=http://127.0.0.1:8001/v1 --out latency.json

TTFT: for each ``--prompt-tokens`` length, ``--repeats`` streamed completions sent one at a time, each
with a prompt of its own (so no prefix cache helps); the figure is the median time to the first text chunk.
TPOT: for each ``--streams`` count, that many streamed completions of ``--output-tokens`` sent at once;
each stream's (last text chunk - first) / (tokens - 1), over the tokens it produced, and the figure is the
median over the streams. Servers run one after the other with the same prompts; each peer's figures are
also shown as a multiple of ``--base-url``'s.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

from bench.http_load import LoadRequest, run_load
from bench.latency import RequestRecord, ms, percentile
from bench.report import format_ratio, format_table, progress, publish, ratio
from bench.targets import Target, comparison_targets
from bench.workload import WorkloadSpec, derived_seed, make_workload, ordinary_token_ids, prompt_text

TTFT_OUTPUT_TOKENS = 4  # a TTFT request's max_tokens: its first text chunk is what is timed


@dataclass(frozen=True)
class Probe:
    """One figure: which latency it takes from each request (``ttft`` or ``tpot``), the prompts, each
    request's max_tokens, and whether the requests go at once (else one after the other)."""

    key: str
    label: str
    measure: str
    prompts: tuple[str, ...]
    max_tokens: int
    concurrent: bool


def make_probes(tokenizer, args: argparse.Namespace) -> list[Probe]:
    """The TTFT probes, then the TPOT probes; each prompt drawn afresh from the seed and the probe's index."""
    ids = ordinary_token_ids(tokenizer)

    def prompts(index: int, count: int, length: int) -> tuple[str, ...]:
        spec = WorkloadSpec(count, (length, length), (1, 1), seed=derived_seed(args.seed, index))
        return tuple(prompt_text(tokenizer, list(r.prompt_ids)) for r in make_workload(spec, ids))

    ttft = [
        Probe(
            f"ttft_{n}",
            f"TTFT, {n}-token prompt",
            "ttft",
            prompts(i, args.repeats, n),
            TTFT_OUTPUT_TOKENS,
            False,
        )
        for i, n in enumerate(args.prompt_tokens)
    ]
    first = len(ttft)
    tpot = [
        Probe(
            f"tpot_{c}",
            f"TPOT, {c} stream{'s' if c > 1 else ''}",
            "tpot",
            prompts(first + i, c, args.stream_prompt_tokens),
            args.output_tokens,
            True,
        )
        for i, c in enumerate(args.streams)
    ]
    return ttft + tpot


async def measure(target: Target, probes: list[Probe]) -> dict:
    """Every probe against one server, after a warm-up request."""
    model = await target.ready_model("latency")
    figures = {}
    for probe in probes:
        progress(f"{target.name}: {probe.label} ({len(probe.prompts)} requests)")
        load = [LoadRequest(0.0, prompt, probe.max_tokens, target.keys[0]) for prompt in probe.prompts]
        batches = [load] if probe.concurrent else [[request] for request in load]
        records = [r for batch in batches for r in await run_load(target.base_url, model, batch)]
        figures[probe.key] = summarize_probe(records, probe.measure)
    return {"base_url": target.base_url, "model": model, "figures": figures}


def summarize_probe(records: list[RequestRecord], measure: str) -> dict:
    """The median of one latency (``ttft`` or ``tpot``) over the requests that produced it, in ms, with the
    median prompt and output token counts and what failed."""
    values = [v for r in records if (v := getattr(r, measure)) is not None]
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    return {
        "median_ms": ms(percentile(values, 50)),
        "samples_ms": [ms(v) for v in values],
        "requests": len(records),
        "failed": len(failed),
        "first_error": (failed[0].error or f"HTTP {failed[0].status}") if failed else None,
        "prompt_tokens": percentile([r.prompt_tokens for r in ok if r.prompt_tokens is not None], 50),
        "output_tokens": percentile([r.output_tokens for r in ok], 50),
    }


def run(args: argparse.Namespace) -> dict:
    from bench.model import bench_model_dir, load_tokenizer

    targets = comparison_targets(args, "latency", None)
    model_dir = bench_model_dir(args.model, "latency")
    probes = make_probes(load_tokenizer(model_dir), args)
    systems = {target.name: asyncio.run(measure(target, probes)) for target in targets}
    base = systems[targets[0].name]["figures"]
    ratios = {
        t.name: {
            p.key: ratio(systems[t.name]["figures"][p.key]["median_ms"], base[p.key]["median_ms"])
            for p in probes
        }
        for t in targets[1:]
    }
    return {
        "benchmark": "latency",
        "model_dir": str(model_dir),
        "settings": {
            "prompt_tokens": args.prompt_tokens,
            "repeats": args.repeats,
            "streams": args.streams,
            "output_tokens": args.output_tokens,
            "stream_prompt_tokens": args.stream_prompt_tokens,
            "seed": args.seed,
        },
        "figures": [{"key": p.key, "label": p.label, "max_tokens": p.max_tokens} for p in probes],
        "systems": systems,
        "ratios": ratios,
    }


def render(result: dict) -> str:
    """One row per figure: each server's median in ms, then each peer's as a multiple of the first's."""
    names = list(result["systems"])
    base, peers = names[0], names[1:]
    headers = ["figure", *(f"{name} ms" for name in names), *(f"{peer}/{base}" for peer in peers)]
    rows = [
        [
            figure["label"],
            *(result["systems"][name]["figures"][figure["key"]]["median_ms"] for name in names),
            *(format_ratio(result["ratios"][peer][figure["key"]]) for peer in peers),
        ]
        for figure in result["figures"]
    ]
    lines = ["medians in ms; a ratio above 1 means the peer is slower", format_table(headers, rows)]
    for name in names:
        for figure in result["figures"]:
            got = result["systems"][name]["figures"][figure["key"]]
            if got["failed"]:
                lines.append(
                    f"{name}: {figure['label']}: {got['failed']} of {got['requests']} requests failed "
                    f"({got['first_error']})"
                )
            elif figure["key"].startswith("tpot") and got["output_tokens"] < figure["max_tokens"]:
                lines.append(
                    f"{name}: {figure['label']}: streams ended after {got['output_tokens']:g} tokens "
                    f"(median), not {figure['max_tokens']}: TPOT is over what they produced"
                )
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    sizes = [*args.prompt_tokens, *args.streams, args.repeats, args.stream_prompt_tokens]
    if min(sizes) < 1:
        raise SystemExit(
            "weir bench latency: error: --prompt-tokens, --streams, --repeats and --stream-prompt-tokens "
            "must be at least 1"
        )
    for option, values in (("--prompt-tokens", args.prompt_tokens), ("--streams", args.streams)):
        if len(set(values)) < len(values):
            raise SystemExit(f"weir bench latency: error: {option} repeats a value")
    if args.output_tokens < 2:
        raise SystemExit("weir bench latency: error: --output-tokens must be at least 2 (TPOT needs two)")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    publish(run(args), args.out, render)
    return 0
