"""`weir plan --validate`: one replica's predicted capacity against the one `weir bench overload` measures.

The prediction is ``engine.capacity_plan.capacity`` for the overload benchmark's mix (prompts of 16-64
tokens, 8-16 output tokens, Poisson arrivals) and targets, with the host work of the server and of the
load generator, which runs on the same cores during the measurement (both measured by the profile). The
engine's steps alone, and with the server's host work only (what a deployment plan counts), are reported
beside it. The measurement starts a database with the
benchmark's three tenants (those targets, weight 1) and one `weir serve --policy fair` of the profiled
model, then runs ``bench.overload_load.measure_capacity`` on it: a burst gauges the throughput, then
Poisson loads bracket the rate that keeps TTFT p99 within the target with nothing refused, to within 10 %.
The capacity lies between the highest rate met and the lowest missed; the ratio is predicted over the rate
met.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import replace
from pathlib import Path

from bench.overload_load import SHAPE, Slo, measure_capacity
from bench.report import progress
from engine.capacity_plan import HostCost, Lengths, Mix, StepProfile, Targets, capacity

OVERLOAD_MIX = Mix(Lengths(*SHAPE.prompt_len), Lengths(*SHAPE.output_len))
WITHIN = 0.15  # the agreement the plan is held to


async def _measure(url: str, model_dir: Path, keys: list[str], slo: Slo, seconds: float, seed: int) -> dict:
    from bench.model import load_tokenizer
    from bench.targets import Target

    model = await Target("plan", url, tuple(keys)).ready_model("plan")
    return await measure_capacity(url, model, keys, load_tokenizer(model_dir), slo, seconds, seed, progress)


def measured_capacity(model_dir: Path, dtype: str, slo: Slo, seconds: float, seed: int) -> dict:
    """``measure_capacity`` on a `weir serve` of ``model_dir`` started here, with the overload tenants."""
    from bench.overload import create_tenants
    from bench.peer_server import free_port
    from bench.soak import soak_database
    from bench.weir_process import ServerError, weir_serve

    with tempfile.TemporaryDirectory(prefix="weir-plan-") as tmp, soak_database(Path(tmp)) as db_url:
        keys = list(asyncio.run(create_tenants(db_url, slo)).values())
        port = free_port(0)
        progress(f"starting weir serve on port {port} ({model_dir})")
        options = ("--policy", "fair", "--dtype", dtype, "--log-level", "warning")
        try:
            with weir_serve(model_dir, port, db_url, Path(tmp), *options) as process:
                return asyncio.run(_measure(process.v1, model_dir, keys, slo, seconds, seed))
        except ServerError as exc:
            raise SystemExit(f"weir plan: error: {exc}") from None


def validate(
    profile: StepProfile,
    host: dict | None,
    model_dir: Path,
    dtype: str,
    targets: Targets,
    seconds: float,
    seed: int,
) -> dict:
    """Predicted and measured capacity of one replica, their ratio and whether it is within ``WITHIN``;
    ``host`` is the profile's host work (``bench.host_cost``), None when it has none."""
    beside = profile
    if profile.host and host:
        beside = replace(profile, host=profile.host.plus(HostCost.from_json(host["client"])))
    alone = capacity(replace(profile, host=None), OVERLOAD_MIX, targets)
    served = capacity(profile, OVERLOAD_MIX, targets)
    predicted = capacity(beside, OVERLOAD_MIX, targets)
    progress(f"predicted capacity {predicted.rate:.3f} req/s; measuring it on a weir serve")
    measured = measured_capacity(model_dir, dtype, Slo(targets.ttft_s, targets.tpot_s), seconds, seed)
    missed_above = measured["missed_at_rps"]
    ratio = predicted.rate / measured["capacity_rps"]
    return {
        "engine_alone_rps": round(alone.rate, 4),
        "server_host_rps": round(served.rate, 4),
        "predicted_rps": round(predicted.rate, 4),
        "predicted_ttft_p99_ms": round(predicted.ttft_p * 1e3, 1),
        "predicted_tpot_p99_ms": round(predicted.tpot_p * 1e3, 1),
        "measured_rps": measured["capacity_rps"],
        "measured_missed_at_rps": missed_above,
        "ratio": round(ratio, 3),
        "within": abs(ratio - 1) <= WITHIN,
        "in_bracket": measured["capacity_rps"] <= predicted.rate < (missed_above or float("inf")),
        "seconds_per_trial": seconds,
        "measurement": measured,
    }
