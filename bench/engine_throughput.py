"""Offline engine throughput: one seeded workload through Weir's engine and `transformers`' own batching.

    weir bench engine [--quick] [--out FILE.json]

The workload (32 requests, prompts of 32-512 real token ids, 32-128 output tokens each, EOS ignored) runs
through (a) Weir's engine, (b) `transformers` continuous batching and (c) padded static ``generate()`` in
batches of 16, on the same weights, in one process: all three are loaded and run a tiny warm-up workload,
untimed, then each repeat's prompts go through the three in that order. The table gives output tokens/s
and Weir's ratio to each peer, and the workload's roofline (``bench/roofline.py``): per step of an ideal
schedule with the engine's limits, the larger of its FLOPs at the rate of a 2048x2048x2048 matmul in the
systems' dtype and its bytes (weights, KV) at the measured memory bandwidth, both measured in the same run.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch

from bench.ceiling import ModelShape, measure_matmul_flops, workload_flops
from bench.hf_peers import load_hf_model, run_generate_batch, run_static_generate
from bench.model import bench_device, bench_model_dir, load_tokenizer
from bench.profile import profile_run
from bench.report import format_table, progress, write_json
from bench.roofline import Machine, ideal_steps, measure_read_bandwidth, roofline_seconds
from bench.workload import (
    FULL,
    QUICK,
    BenchRequest,
    SystemResult,
    WorkloadSpec,
    check_lengths,
    derived_seed,
    make_workload,
    ordinary_token_ids,
    redraw_prompts,
)
from engine.types import SamplingParams

WARMUP = WorkloadSpec(num_requests=2, prompt_len=(8, 16), output_len=(2, 4), seed=1)
TARGETS = {"transformers_generate_batch": 8.0, "transformers_static_generate": 4.0}
ROOFLINE_TARGET = 0.6

Runner = Callable[[Sequence[BenchRequest]], SystemResult]


def run(args: argparse.Namespace) -> dict:
    model_dir = bench_model_dir(args.model, "engine")
    device = bench_device()
    token_ids = ordinary_token_ids(load_tokenizer(model_dir))
    base = QUICK if args.quick else FULL
    spec = WorkloadSpec(base.num_requests, base.prompt_len, base.output_len, seed=args.seed)
    workload = make_workload(spec, token_ids)
    warmup = make_workload(WARMUP, token_ids)
    prompt_tokens = sum(r.prompt_len for r in workload)
    output_tokens = sum(r.output_len for r in workload)
    progress(
        f"workload: {len(workload)} requests, {prompt_tokens} prompt and {output_tokens} output tokens; "
        f"device {device}, {torch.get_num_threads()} threads"
    )

    dtype = _resolved_dtype(args.dtype, model_dir, device)
    progress(f"measuring the 2048^3 {dtype} matmul rate")
    matmul_before = measure_matmul_flops(device, dtype=dtype)
    shape = ModelShape.from_model_dir(model_dir)
    total_flops = workload_flops(shape, [(r.prompt_len, r.output_len) for r in workload])

    runners: dict[str, Callable[[], Runner]] = {
        "weir": lambda: _weir_runner(model_dir, device, dtype),
        "transformers_generate_batch": lambda: _hf_runner(model_dir, device, dtype, run_generate_batch),
        "transformers_static_generate": lambda: _hf_runner(model_dir, device, dtype, run_static_generate),
    }
    # the first run takes the workload's prompts; each repeat fresh ones (so that no prefix cache helps)
    repeats = [workload] + [
        redraw_prompts(workload, token_ids, derived_seed(args.seed, 2 + r)) for r in range(args.repeats - 1)
    ]
    loaded: dict[str, Runner] = {}
    for name, make_runner in runners.items():
        progress(f"{name}: loading and warming up")
        loaded[name] = make_runner()
        loaded[name](warmup)
    # rounds: every system runs each repeat's prompts in turn, so that a host whose speed drifts over
    # minutes slows every system alike instead of whichever ran during its slow spell
    results: dict[str, list[SystemResult]] = {name: [] for name in loaded}
    for index, prompts in enumerate(repeats, 1):
        for name, runner in loaded.items():
            progress(f"{name}: running the workload ({index}/{len(repeats)})")
            done = runner(prompts)
            results[name].append(done)
            progress(f"{name}: {done.output_tokens_per_s:.1f} output tokens/s in {done.seconds:.1f}s")
    systems = {}
    for name, runs in results.items():
        result = median_run(runs)
        systems[name] = {
            "label": result.name,
            "output_tokens_per_s": round(result.output_tokens_per_s, 3),
            "seconds": round(result.seconds, 3),
            "output_tokens": result.output_tokens,
            "computed_output_tokens": result.computed_tokens,
            **({"notes": result.notes} if result.notes else {}),
            **result.extra,
        }
        if len(runs) > 1:
            systems[name]["runs_tokens_per_s"] = [round(r.output_tokens_per_s, 3) for r in runs]
    if args.profile:
        progress("weir: running the workload again, with fresh prompts, under the torch profiler")
        fresh = redraw_prompts(workload, token_ids, derived_seed(args.seed, 1))  # no prefix-cache hit
        systems["weir"]["profile"] = profile_run(partial(loaded["weir"], fresh))
    del loaded
    progress("measuring the matmul rate again, and the memory bandwidth")
    matmul_flops = max(matmul_before, measure_matmul_flops(device, dtype=dtype))  # the higher ceiling
    machine = Machine(matmul_flops, measure_read_bandwidth(device))
    roofline = output_tokens / _roofline_seconds(shape, workload, dtype, machine)
    weir = systems["weir"]["output_tokens_per_s"]
    return {
        "benchmark": "engine",
        "model_dir": str(model_dir),
        "machine": {
            "device": device,
            "torch_threads": torch.get_num_threads(),
            "dtype": dtype,
            "cpu": platform.processor() or platform.machine(),
        },
        "workload": {
            "requests": len(workload),
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "seed": spec.seed,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "flops": total_flops,
        },
        "matmul_gflops": round(matmul_flops / 1e9, 2),
        "bandwidth_gb_s": round(machine.bytes_per_s / 1e9, 2),
        "roofline_tokens_per_s": round(roofline, 3),
        "weir_fraction_of_roofline": round(weir / roofline, 4),
        "weir_ratio": {
            name: round(weir / s["output_tokens_per_s"], 3) for name, s in systems.items() if name != "weir"
        },
        "systems": systems,
    }


def median_run(results: Sequence[SystemResult]) -> SystemResult:
    """The run with the median output tokens/s (the lower middle one of an even count)."""
    ranked = sorted(results, key=lambda r: r.output_tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def _roofline_seconds(
    shape: ModelShape, workload: Sequence[BenchRequest], dtype: str, machine: Machine
) -> float:
    """The workload's roofline time with the engine's default limits."""
    from engine.config import EngineConfig

    limits = EngineConfig()
    steps = ideal_steps(
        shape,
        [(r.prompt_len, r.output_len) for r in workload],
        max_num_seqs=limits.max_num_seqs,
        max_batched_tokens=limits.max_batched_tokens,
        prefill_chunk_size=limits.prefill_chunk_size,
        bytes_per_value=getattr(torch, dtype).itemsize,
    )
    return roofline_seconds(steps, machine)


def _resolved_dtype(name: str, model_dir, device: str) -> str:
    """The dtype every system runs in: ``name``, or for ``auto`` the one Weir's engine would choose."""
    if name != "auto":
        return name
    from engine.models.config import ModelConfig
    from engine.models.dtype_choice import choose_dtype

    progress("choosing the dtype (timing the model's shapes)")
    chosen = choose_dtype(ModelConfig.from_dir(model_dir), torch.device(device)).dtype
    return str(chosen).removeprefix("torch.")


def _hf_runner(model_dir, device: str, dtype: str, run_system) -> Runner:
    model = load_hf_model(str(model_dir), device, dtype)
    return lambda workload: run_system(model, workload)


def _weir_runner(model_dir, device: str, dtype: str) -> Runner:
    """Weir's engine with its default configuration, stepped here so that progress can be shown."""
    from engine.config import EngineConfig
    from engine.core import EngineCore

    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype)
    core = EngineCore.from_config(config, progress=False)
    return lambda workload: run_weir(core, workload)


def run_weir(core, workload: Sequence[BenchRequest]) -> SystemResult:
    """Submit the whole workload at once (greedy, EOS ignored) and step the engine until it is done."""
    start = time.perf_counter()
    for i, request in enumerate(workload):
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        core.add_request(f"bench-{i}", list(request.prompt_ids), params)
    done: dict[str, int] = {}
    steps = 0
    while core.has_unfinished():
        steps += 1
        for out in core.step():
            if out.finished:
                if out.error:
                    raise RuntimeError(f"Weir's engine failed {out.request_id}: {out.error}")
                done[out.request_id] = out.output_tokens
                progress(f"  weir: {len(done)}/{len(workload)} requests done ({steps} steps)")
    seconds = time.perf_counter() - start
    got = [done[f"bench-{i}"] for i in range(len(workload))]
    check_lengths("weir", got, [r.output_len for r in workload])
    return SystemResult("weir engine", seconds, sum(got), sum(got), extra={"steps": steps})


def render(result: dict) -> str:
    """Systems with tokens/s and Weir's ratio to each (with its target), then the roofline."""
    rows = []
    for name, s in result["systems"].items():
        ratio = result["weir_ratio"].get(name)  # None for Weir itself
        shown = None if ratio is None else f"{ratio:.2f}x"
        verdict = (
            "" if ratio is None else f">= {TARGETS[name]:g}x {'met' if ratio >= TARGETS[name] else 'MISSED'}"
        )
        rows.append([s["label"], s["output_tokens_per_s"], s["seconds"], s["output_tokens"], shown, verdict])
    fraction = result["weir_fraction_of_roofline"]
    verdict = f">= {ROOFLINE_TARGET:.0%} {'met' if fraction >= ROOFLINE_TARGET else 'MISSED'}"
    rows.append(["roofline", result["roofline_tokens_per_s"], None, None, f"{fraction:.0%}", verdict])
    table = format_table(["system", "output tok/s", "seconds", "tokens", "Weir ratio", "target"], rows)
    w = result["workload"]
    return "\n".join(
        [
            f"workload: {w['requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens "
            f"({w['prompt_tokens']} total), outputs {w['output_len'][0]}-{w['output_len'][1]} "
            f"({w['output_tokens']} total), {w['flops'] / 1e9:.1f} GFLOP",
            f"every system in {result['machine']['dtype']}; matmul 2048^3 in it: "
            f"{result['matmul_gflops']:.1f} GFLOP/s on {result['machine']['device']} "
            "(the better of two measurements, before and after the systems ran); memory read "
            f"{result['bandwidth_gb_s']:.1f} GB/s",
            table,
            *_render_runs(result["systems"]),
            *(f"{s['label']}: {s['notes']}" for s in result["systems"].values() if "notes" in s),
            *_render_profile(result["systems"]["weir"].get("profile")),
        ]
    )


def _render_runs(systems: dict) -> list[str]:
    """With ``--repeats``: that each figure is a median, and every run's tokens/s."""
    if not any("runs_tokens_per_s" in s for s in systems.values()):
        return []
    runs = "; ".join(
        f"{s['label']} {', '.join(f'{t:.1f}' for t in s['runs_tokens_per_s'])}"
        for s in systems.values()
        if "runs_tokens_per_s" in s
    )
    return [f"each system's median run of its repeats (fresh prompts each), tokens/s of every run: {runs}"]


def _render_profile(profile: dict | None) -> list[str]:
    if profile is None:
        return []
    return [
        f"weir under the profiler: {profile['wall_s']:.2f}s wall, {profile['op_s']:.2f}s in torch operators, "
        f"{profile['outside_ops_s']:.2f}s outside them (Python, scheduling, sampling glue)",
        format_table(
            ["operator", "self s", "calls"], [[o["op"], o["self_s"], o["calls"]] for o in profile["top_ops"]]
        ),
    ]


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.out:
        write_json(args.out, result)
        progress(f"wrote {args.out}")
    print(render(result))
    return 0


if __name__ == "__main__":
    from bench.cli import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="python -m bench.engine_throughput", description=__doc__.splitlines()[0]
    )
    add_engine_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
