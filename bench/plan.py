"""`weir plan`: replicas for a request mix and rate, from a measured step profile (engine/capacity_plan.py).

    weir plan [--profile FILE] [--model PATH] [--dtype auto] [--rate R] [--prompt-tokens DIST]
              [--output-tokens DIST] [--ttft-ms T] [--tpot-ms T] [--failures 1] [--out FILE.json]
    weir plan --validate [--profile FILE] [--validate-seconds S]

Without ``--profile`` it reads the profile cached in the state directory for the model and dtype, and
measures a quick one (``weir bench profile --quick``) when there is none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.report import format_table, progress, publish
from bench.step_profile import host_line
from engine.capacity_plan import Lengths, Mix, Plan, StepProfile, Targets, make_plan


def load_profile(args: argparse.Namespace) -> tuple[dict, Path | None]:
    """The profile's JSON: ``--profile``, else the cached one, else a quick one measured now; and the model
    directory when it is known here."""
    from bench.model import bench_model_dir
    from bench.step_profile import cached_profile_path, profile_model
    from engine.weights import state_dir_from_env

    if args.profile:
        try:
            data = json.loads(Path(args.profile).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"weir plan: error: cannot read the profile {args.profile}: {exc}") from None
        return data, (bench_model_dir(args.model, "plan") if args.model or args.validate else None)
    model_dir = bench_model_dir(args.model, "plan")
    cached = cached_profile_path(state_dir_from_env(), model_dir, args.dtype)
    if cached.exists():
        progress(f"using the profile measured at {json.loads(cached.read_text())['measured_at']}: {cached}")
        return json.loads(cached.read_text()), model_dir
    progress(f"no profile of {model_dir.name} ({args.dtype}) yet: measuring a quick one")
    return profile_model(model_dir, args.dtype, quick=True), model_dir


def parse_profile(data: dict) -> StepProfile:
    try:
        return StepProfile.from_json(data)
    except ValueError as exc:
        raise SystemExit(f"weir plan: error: {exc}") from None


def plan_figures(plan: Plan) -> dict:
    """The plan's figures, as JSON."""
    n, spares = plan.replicas, plan.replicas_with_spares
    return {
        "rate_rps": plan.rate,
        "replica_capacity_rps": round(plan.capacity, 4),
        "replica_ttft_p99_ms": round(plan.replica.ttft_p * 1e3, 1),
        "replica_tpot_p99_ms": round(plan.replica.tpot_p * 1e3, 1),
        "replica_peak_kv_tokens": plan.replica.peak_kv_tokens,
        "kv_tokens": plan.kv_tokens,
        "replicas": n,
        "utilization": round(plan.utilization(n), 4),
        "failures": plan.failures,
        "replicas_with_spares": spares,
        "utilization_with_spares": round(plan.utilization(spares), 4),
        "spare_rps": round(plan.spare_rps, 4),
        "load_s": plan.load_s,
        "excess_without_spares_rps": round(plan.excess_without_spares_rps, 4),
        "excess_requests": round(plan.excess_requests, 1),
    }


def render(result: dict) -> str:
    """The profile and mix it rests on, then a row per fleet: none failed, with spares, failed without."""
    p, figures = result["profile"], result["plan"]
    n, spares, failures = figures["replicas"], figures["replicas_with_spares"], figures["failures"]
    capacity = figures["replica_capacity_rps"]
    rows = [
        ["one replica", 1, capacity, None, None],
        ["no failure", n, round(n * capacity, 3), round(100 * figures["utilization"], 1), 0],
    ]
    if failures:
        rows.append(
            [
                f"N+{failures} (survives {failures} failure{'s' * (failures != 1)})",
                spares,
                round(spares * capacity, 3),
                round(100 * figures["utilization_with_spares"], 1),
                figures["spare_rps"],
            ]
        )
    lines = [
        f"profile: {p['model']} ({p['dtype']}, {p['device']}, {p['threads']} threads), measured "
        f"{p['measured_at']} at load average {p['load_average'][0]}; model load {p['load_s']:.1f} s",
        host_line(p["host"])
        if p.get("host")
        else "no host work in the profile (measured before it was): the plan counts the engine's steps "
        "alone and is optimistic; measure it again with weir bench profile",
        f"mix: prompts {result['prompt_tokens']} tokens, outputs {result['output_tokens']} tokens, Poisson "
        f"arrivals at {figures['rate_rps']:g} req/s; targets TTFT p99 <= {result['ttft_ms']:g} ms, "
        f"TPOT p99 <= {result['tpot_ms']:g} ms",
        f"one replica: {capacity} req/s within the targets (simulated TTFT p99 "
        f"{figures['replica_ttft_p99_ms']} ms, TPOT p99 {figures['replica_tpot_p99_ms']} ms at that rate; "
        f"KV held at most {figures['replica_peak_kv_tokens']} tokens of the pool's {figures['kv_tokens']})",
        format_table(["fleet", "replicas", "capacity req/s", "utilization %", "warm spare req/s"], rows),
    ]
    if figures["replica_peak_kv_tokens"] > figures["kv_tokens"]:
        lines.append(
            "the schedule holds more KV than the pool: preemption would slow it, the plan is optimistic"
        )
    if failures:
        lines.append(
            f"without spares, {failures} failed leave{'s' * (failures == 1)} {max(0, n - failures)} of {n} "
            f"replicas; for the {figures['load_s']:.1f} s a replacement takes to load, "
            f"{figures['excess_without_spares_rps']} req/s are over capacity: about "
            f"{figures['excess_requests']} requests refused or served late"
        )
    if result.get("by_prompt"):
        lines += [
            f"by prompt length (outputs {result['output_tokens']} tokens, {figures['rate_rps']:g} req/s)",
            format_table(
                ["prompt tokens", "replica req/s", "TTFT p99 ms", "TPOT p99 ms", "replicas", f"N+{failures}"],
                [
                    [row["prompt_tokens"]]
                    + [
                        row.get(k)
                        for k in ("replica_capacity_rps", "replica_ttft_p99_ms", "replica_tpot_p99_ms")
                    ]
                    + [row.get("replicas"), row.get("replicas_with_spares")]
                    for row in result["by_prompt"]
                ],
            ),
        ]
    validation = result.get("validation")
    if validation:
        lines += [
            "validation: one replica, the overload benchmark's mix (prompts 16-64, outputs 8-16 tokens); "
            "predicted with the host work of the server and of the load generator beside it",
            format_table(
                [
                    "engine alone req/s",
                    "+ server host req/s",
                    "predicted req/s",
                    "measured req/s",
                    "missed at req/s",
                    "predicted / measured",
                    "within 15 %",
                ],
                [
                    [
                        validation["engine_alone_rps"],
                        validation["server_host_rps"],
                        validation["predicted_rps"],
                        validation["measured_rps"],
                        validation["measured_missed_at_rps"],
                        validation["ratio"],
                        "yes" if validation["within"] else "no",
                    ]
                ],
            ),
        ]
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> tuple[Mix, Targets]:
    try:
        mix = Mix(Lengths.parse(args.prompt_tokens), Lengths.parse(args.output_tokens))
    except ValueError as exc:
        raise SystemExit(f"weir plan: error: {exc}") from None
    if min(args.rate, args.ttft_ms, args.tpot_ms, args.validate_seconds) <= 0:
        raise SystemExit("weir plan: error: --rate, the targets and --validate-seconds must be positive")
    if args.failures < 0 or args.requests < 20:
        raise SystemExit("weir plan: error: --failures must not be negative and --requests at least 20")
    return mix, Targets(args.ttft_ms / 1000, args.tpot_ms / 1000)


def by_prompt(profile: StepProfile, mix: Mix, targets: Targets, args: argparse.Namespace) -> dict:
    """One row of the comparison by prompt length: the plan's figures, or why no plan meets the targets."""
    row: dict = {"prompt_tokens": str(mix.prompt)}
    try:
        row.update(plan_figures(make_plan(profile, mix, targets, args.rate, args.failures, args.requests)))
    except ValueError as exc:
        row["error"] = str(exc)
    return row


def run(args: argparse.Namespace) -> dict:
    mix, targets = check_arguments(args)
    try:
        args.compare_prompt_tokens = [Lengths.parse(text) for text in args.compare_prompt_tokens]
    except ValueError as exc:
        raise SystemExit(f"weir plan: error: {exc}") from None
    data, model_dir = load_profile(args)
    profile = parse_profile(data)
    progress("simulating the step schedule to find one replica's capacity")
    try:
        plan = make_plan(profile, mix, targets, args.rate, args.failures, args.requests)
    except ValueError as exc:
        raise SystemExit(f"weir plan: error: {exc}") from None
    summary = {k: data.get(k) for k in ("model", "dtype", "device", "threads", "measured_at", "load_average")}
    result = {
        "profile": {**summary, "load_s": profile.load_s, "host": data.get("host")},
        "prompt_tokens": str(mix.prompt),
        "output_tokens": str(mix.output),
        "ttft_ms": args.ttft_ms,
        "tpot_ms": args.tpot_ms,
        "plan": plan_figures(plan),
    }
    if args.compare_prompt_tokens:
        progress("and for each of --compare-prompt-tokens")
        result["by_prompt"] = [
            by_prompt(profile, Mix(prompt, mix.output), targets, args)
            for prompt in args.compare_prompt_tokens
        ]
    if args.validate:
        from bench.plan_validation import validate

        result["validation"] = validate(
            profile, data.get("host"), model_dir, args.dtype, targets, args.validate_seconds, args.seed
        )
    return result


def main(args: argparse.Namespace) -> int:
    publish(run(args), args.out, render)
    return 0
