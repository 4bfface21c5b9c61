"""`weir bench profile`: the step times and load time of one model here, the input of `weir plan`.

    weir bench profile [--model PATH] [--dtype auto] [--quick] [--out FILE.json]
                       [--prefill-tokens N ...] [--decodes N ...] [--contexts N ...] [--repeats N]

On the in-process engine (the engine `weir serve` runs, with its default limits), it times steps of every
pair of the grid's prefill tokens x decodes (the decodes at the first of ``--contexts`` tokens of context
each), then one batch of decodes at each of ``--contexts``, with ``engine.calibration.calibrate`` on scratch
KV blocks: the median of ``--repeats`` runs of each step. The model's **load time** is measured in a fresh
Python process, from its start to an engine ready to step: imports, the weights, the dtype choice, the KV
pool and the start-up calibration (no HTTP server, no database; `weir serve` adds their start-up). The
attention kernel is built before (once per machine; a first start on a new machine also compiles it).
Last, the **host work** per request and per output token, outside the engine, of a `weir serve` and of a
load generator beside it (``bench.host_cost``; it starts a database and the server).

The profile is written to the state directory (``profiles/MODEL-DTYPE.json``, where `weir plan` looks for
it) and to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.report import format_table, progress, write_json
from engine.capacity_plan import PROFILE_KIND, PROFILE_VERSION
from engine.config import EngineConfig

FULL_GRID = {"prefill_tokens": (0, 16, 64, 128, 256, 512), "decodes": (0, 1, 4, 16, 64)}
QUICK_GRID = {"prefill_tokens": (0, 64, 256), "decodes": (0, 1, 8)}
FULL_CONTEXTS, QUICK_CONTEXTS = (64, 256, 1024), (64, 256)
REPEATS = 3
REPO_ROOT = Path(__file__).resolve().parents[1]
_LOAD_SCRIPT = (
    "import json, sys\n"
    "from engine.config import EngineConfig\n"
    "from engine.core import EngineCore\n"
    "EngineCore.from_config(EngineConfig(**json.loads(sys.argv[1])), progress=False)\n"
    "print('ready', flush=True)\n"
)


def cached_profile_path(state_dir: Path, model_dir: Path, dtype: str) -> Path:
    """Where the profile of ``model_dir`` at ``dtype`` is kept for `weir plan`."""
    return state_dir / "profiles" / f"{model_dir.name}-{dtype}.json"


def measure_load_s(config: EngineConfig) -> float:
    """Seconds from starting a Python process to its engine being ready (the model loaded, calibrated)."""
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()}
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-c", _LOAD_SCRIPT, json.dumps(fields)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        text=True,
    )
    ready = process.stdout.readline().strip() == "ready"
    load_s = time.perf_counter() - started
    _, errors = process.communicate()
    if not ready or process.returncode != 0:
        raise SystemExit(f"weir bench profile: error: the engine did not start: {errors.strip()[-500:]}")
    return load_s


def _sizes(values: tuple[int, ...], cap: int, floor: int = 0) -> tuple[int, ...]:
    return tuple(sorted({min(max(v, floor), cap) for v in values}))


def measure(config: EngineConfig, grid: dict, contexts: tuple[int, ...], repeats: int) -> dict:
    """The step grid and the context sweep on an engine built from ``config``; the profile's JSON."""
    import torch

    from engine.calibration import calibrate
    from engine.core import EngineCore

    progress("starting the engine here")
    core = EngineCore.from_config(config, progress=False)  # builds the attention kernel if it is not yet
    progress("measuring the load time in a fresh process")
    load_s = measure_load_s(config)
    progress(f"load time {load_s:.2f} s")
    limits = core.scheduler
    rows = _sizes(grid["prefill_tokens"], min(limits.max_batched_tokens, core.max_model_len))
    columns = _sizes(grid["decodes"], limits.max_num_seqs)
    contexts = _sizes(contexts, core.max_model_len - 1, floor=2)
    context, context_decodes = contexts[0], columns[-1]
    calibrate(core.runner, [(rows[-1], columns[-1])], context, repeats)  # a warm-up at the largest step
    seconds: list[list[float | None]] = []
    for prefill in rows:
        shapes = [(prefill, d) for d in columns if prefill or d]
        samples = calibrate(core.runner, shapes, context, repeats, statistic=statistics.median)
        if len(samples) != len(shapes):
            raise SystemExit("weir bench profile: error: the KV pool cannot hold the grid's largest steps")
        seconds.append(([None] if not prefill else []) + [s.seconds for s in samples])
        shown = ", ".join(
            f"{d} decodes {s * 1e3:.1f} ms" for d, s in zip(columns, seconds[-1], strict=True) if s
        )
        progress(f"prefill {prefill} tokens + {shown}")
    sweep = []
    for c in contexts:
        samples = calibrate(core.runner, [(0, context_decodes)], c, repeats, statistic=statistics.median)
        if not samples:
            raise SystemExit(
                f"weir bench profile: error: the KV pool cannot hold {context_decodes} x {c} tokens"
            )
        sweep.append(samples[0].seconds)
        progress(f"{context_decodes} decodes at {c} tokens of context: {sweep[-1] * 1e3:.1f} ms")
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "model": core.model_name,
        "dtype": str(core.runner.model.dtype).removeprefix("torch."),
        "device": str(core.device),
        "threads": torch.get_num_threads(),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "load_s": round(load_s, 3),
        "load_measured": "a fresh Python process, start to engine ready (no HTTP server, no database)",
        "engine": {
            "max_batched_tokens": limits.max_batched_tokens,
            "max_num_seqs": limits.max_num_seqs,
            "prefill_chunk_size": limits.prefill_chunk_size,
            "max_model_len": core.max_model_len,
            "kv_tokens": core.kv.capacity_tokens,
        },
        "steps": {
            "prefill_tokens": list(rows),
            "decodes": list(columns),
            "context": context,
            "seconds": [[None if s is None else round(s, 6) for s in row] for row in seconds],
        },
        "context": {
            "decodes": context_decodes,
            "contexts": list(contexts),
            "seconds": [round(s, 6) for s in sweep],
        },
    }


def render(profile: dict) -> str:
    """The step grid in ms (a row per prefill size), the context sweep and the load time."""
    steps, ctx = profile["steps"], profile["context"]
    headers = ["prefill tokens"] + [f"{d} decodes" for d in steps["decodes"]]
    rows = [
        [p] + [None if s is None else round(s * 1e3, 1) for s in row]
        for p, row in zip(steps["prefill_tokens"], steps["seconds"], strict=True)
    ]
    sweep = [[c, round(s * 1e3, 1)] for c, s in zip(ctx["contexts"], ctx["seconds"], strict=True)]
    return "\n".join(
        [
            f"{profile['model']} ({profile['dtype']}, {profile['device']}, {profile['threads']} threads): "
            f"step times in ms, decodes at {steps['context']} tokens of context",
            format_table(headers, rows),
            f"{ctx['decodes']} decodes by context",
            format_table(["context tokens", "ms"], sweep),
            f"load time {profile['load_s']:.2f} s ({profile['load_measured']})",
            *([host_line(profile["host"])] if profile.get("host") else []),
        ]
    )


def host_line(host: dict) -> str:
    """The host work of the server and of the load generator, per request and per output token."""
    server, client = host["server"], host["client"]
    return (
        f"host work on {server['cores']} cores: weir serve {server['request_s'] * 1e3:.2f} ms CPU a request "
        f"+ {server['token_s'] * 1e3:.3f} ms an output token; a load generator beside it "
        f"{client['request_s'] * 1e3:.2f} ms + {client['token_s'] * 1e3:.3f} ms"
    )


def engine_config(model_dir: Path, dtype: str) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype=dtype)


def profile_model(model_dir: Path, dtype: str, quick: bool, args: argparse.Namespace | None = None) -> dict:
    """Measure the profile of ``model_dir`` (sizes from ``args`` where given) and cache it."""
    from engine.weights import state_dir_from_env

    grid = dict(QUICK_GRID if quick else FULL_GRID)
    contexts = QUICK_CONTEXTS if quick else FULL_CONTEXTS
    repeats = REPEATS
    if args is not None:
        grid["prefill_tokens"] = tuple(args.prefill_tokens or grid["prefill_tokens"])
        grid["decodes"] = tuple(args.decodes or grid["decodes"])
        contexts = tuple(args.contexts or contexts)
        repeats = args.repeats
    from bench.host_cost import measure_host_cost

    result = measure(engine_config(model_dir, dtype), grid, contexts, repeats)
    result["host"] = measure_host_cost(model_dir, dtype)
    cached = cached_profile_path(state_dir_from_env(), model_dir, dtype)
    write_json(cached, result)
    progress(f"wrote {cached}")
    return result


def check_arguments(args: argparse.Namespace) -> None:
    for name in ("prefill_tokens", "decodes"):
        values = getattr(args, name)
        if values and (0 not in values or len(set(values)) < 2 or min(values) < 0):
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"weir bench profile: error: {flag} needs 0 and at least one positive size")
    if args.contexts and min(args.contexts) < 2:
        raise SystemExit("weir bench profile: error: --contexts must be at least 2 tokens")
    if args.repeats < 1:
        raise SystemExit("weir bench profile: error: --repeats must be positive")


def main(args: argparse.Namespace) -> int:
    from bench.model import bench_model_dir

    check_arguments(args)
    model_dir = bench_model_dir(args.model, "profile")
    result = profile_model(model_dir, args.dtype, args.quick, args)
    if args.out:
        write_json(args.out, result)
        progress(f"wrote {args.out}")
    print(render(result))
    return 0
