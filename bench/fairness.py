"""Fair share by cost: FCFS and weighted fair share side by side on the VTC paper's workloads.

    weir bench fairness [--quick] [--out FILE.json] [--model PATH] [--dtype D] [--steps N] [--seconds S]

Each workload of ``bench.fairness_workloads`` (rate, shapes, weights, onoff) runs through Weir's engine in
this process for ``--steps`` engine steps (40 with ``--quick``, else 160), or ``--seconds`` if that ends it
first, once with each policy, on one loaded model; each run has an engine of its own (fresh KV pool and
prefix cache). The engine runs at most ``MAX_NUM_SEQS`` sequences, so backlogged tenants' requests wait and
the policy chooses. Service is measured as the engine charges it (``bench.service_meter``): cost units of
computed prefill, cached prompt and output tokens. Per tenant: its share of the service during the steps
in which every tenant was backlogged, against its weight share, and its service per second over the run;
per run: the largest difference of weighted service between two backlogged tenants over any span of steps,
against the VTC bound 2 * max(w_prefill * longest prompt, w_decode * KV pool tokens), and output tokens/s.
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from bench.fairness_workloads import WORKLOADS, RequestSource, Workload
from bench.report import format_ratio, format_table, progress, publish, ratio
from bench.service_meter import MeteredPolicy, StepRecord, contended_service, max_weighted_gap
from engine.cost import DEFAULT_WEIGHTS
from engine.types import SamplingParams

POLICIES = ("fcfs", "fair")
MAX_NUM_SEQS = 8  # running sequences: fewer than the tenants keep in the engine, so requests queue
BLOCK_SIZE = 16
QUICK_STEPS, FULL_STEPS = 40, 160


@dataclass(frozen=True)
class RunLength:
    """A run ends after ``steps`` engine steps, or after ``seconds`` (when set) if that comes first."""

    steps: int
    seconds: float | None = None

    def progress(self, elapsed: float, steps: int) -> float:
        """How far through the run (1 or more: it is over)."""
        return max(steps / self.steps, elapsed / self.seconds if self.seconds else 0.0)


def kv_pool_blocks() -> int:
    """Blocks for ``MAX_NUM_SEQS`` of the longest request of any workload: no preemption needed."""
    longest = max(t.max_tokens() for w in WORKLOADS for t in w.tenants)
    return MAX_NUM_SEQS * math.ceil(longest / BLOCK_SIZE)


def bound(workload: Workload, kv_tokens: int) -> float:
    """The VTC bound on backlogged tenants' weighted service difference for this workload."""
    longest_prompt = max(t.prompt_len[1] for t in workload.tenants)
    return 2 * max(DEFAULT_WEIGHTS.prefill * longest_prompt, DEFAULT_WEIGHTS.decode * kv_tokens)


def run_workload(core, workload: Workload, token_ids: Sequence[int], seed: int, length: RunLength) -> dict:
    """Drive ``core`` (an idle ``EngineCore`` whose policy is a ``MeteredPolicy``) with the workload's
    tenants for ``length``; the run's figures."""
    meter: MeteredPolicy = core.scheduler.policy
    sources = {t.name: RequestSource(t, token_ids, seed) for t in workload.tenants}
    in_engine: Counter[str] = Counter()
    sent: Counter[str] = Counter()
    owner: dict[str, str] = {}
    records = [StepRecord({}, frozenset())]
    output_tokens = steps = 0
    start = time.perf_counter()
    while (done := length.progress(time.perf_counter() - start, steps)) < 1:
        while sending := [
            t for t in workload.tenants if t.wants(in_engine[t.name], sent[t.name], done)
        ]:  # one request per tenant in turn, so arrivals interleave
            for tenant in sending:
                request = sources[tenant.name].next()
                request_id = f"{tenant.name}-{sent[tenant.name]}"
                params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
                core.add_request(
                    request_id, list(request.prompt_ids), params, tenant.name, weight=tenant.weight
                )
                owner[request_id] = tenant.name
                in_engine[tenant.name] += 1
                sent[tenant.name] += 1
        backlogged = frozenset(name for name, count in in_engine.items() if count)
        for out in core.step():
            if out.error:
                raise RuntimeError(f"the engine failed {out.request_id}: {out.error}")
            output_tokens += len(out.token_ids)
            if out.finished:
                in_engine[owner.pop(out.request_id)] -= 1
        steps += 1
        records.append(StepRecord(dict(meter.served), backlogged))
    seconds = time.perf_counter() - start
    core.end_all("abort")
    weights = {t.name: t.weight for t in workload.tenants}
    contended = contended_service(records, frozenset(weights))
    total, weight_total = sum(contended.values()), sum(weights.values())
    return {
        "throughput_tokens_per_s": round(output_tokens / seconds, 3),
        "max_weighted_gap": round(max_weighted_gap(records, weights), 1),
        "bound": bound(workload, core.kv.capacity_tokens),
        "tenants": {
            name: {
                "weight": weight,
                "share": round(contended[name] / total, 4) if total else None,
                "weight_share": round(weight / weight_total, 4),
                "service_per_s": round(meter.served[name] / seconds, 2),
                "requests_sent": sent[name],
            }
            for name, weight in weights.items()
        },
        "seconds": round(seconds, 2),
        "steps": steps,
        "contended_steps": sum(1 for r in records[1:] if frozenset(weights) <= r.backlogged),
        "output_tokens": output_tokens,
    }


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.model import bench_device, bench_model_dir, load_tokenizer
    from bench.workload import ordinary_token_ids
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.models import load_model
    from engine.tokenizer import Tokenizer

    model_dir = bench_model_dir(args.model, "fairness")
    device = bench_device()
    progress(f"loading {model_dir} ({args.dtype}) on {device}")
    model = load_model(model_dir, device, args.dtype)
    tokenizer = Tokenizer(model_dir)
    token_ids = ordinary_token_ids(load_tokenizer(model_dir))
    length = RunLength(args.steps or (QUICK_STEPS if args.quick else FULL_STEPS), args.seconds)
    num_blocks = kv_pool_blocks()

    def new_core(policy: str) -> EngineCore:
        """An engine of its own on the loaded model (its start-up step calibration runs the model at the
        usual step shapes, which also warms them up)."""
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, policy=policy)
        core = EngineCore(model, tokenizer, config, num_blocks=num_blocks, device=torch.device(device))
        core.scheduler.policy = MeteredPolicy(core.scheduler.policy)
        return core

    progress("warming up: one engine's step calibration")
    new_core("fcfs")
    workloads = {}
    for workload in WORKLOADS:
        workloads[workload.name] = {}
        for policy in POLICIES:
            progress(f"{workload.name} with {policy}: {workload.description}")
            result = run_workload(new_core(policy), workload, token_ids, args.seed, length)
            progress(
                f"  {result['steps']} steps in {result['seconds']} s, "
                f"{result['throughput_tokens_per_s']} output tokens/s"
            )
            workloads[workload.name][policy] = result
    return {
        "benchmark": "fairness",
        "model_dir": str(model_dir),
        "engine": {
            "device": device,
            "dtype": str(model.dtype).removeprefix("torch."),
            "max_num_seqs": MAX_NUM_SEQS,
            "kv_pool_tokens": num_blocks * BLOCK_SIZE,
        },
        "cost_weights": {
            "prefill": DEFAULT_WEIGHTS.prefill,
            "cached": DEFAULT_WEIGHTS.cached,
            "decode": DEFAULT_WEIGHTS.decode,
        },
        "run": {"steps": length.steps, "seconds": length.seconds, "seed": args.seed},
        "descriptions": {w.name: w.description for w in WORKLOADS},
        "workloads": workloads,
    }


def render(result: dict) -> str:
    """A table per workload (each policy's tenants), then the policies side by side."""
    lines = []
    summary = []
    for name, runs in result["workloads"].items():
        rows = [
            [
                policy,
                tenant,
                t["weight"],
                t["weight_share"],
                t["share"],
                format_ratio(ratio(t["share"], t["weight_share"])),
                t["service_per_s"],
            ]
            for policy, r in runs.items()
            for tenant, t in r["tenants"].items()
        ]
        headers = ["policy", "tenant", "weight", "weight share", "share", "share/weight share", "cost/s"]
        lines += [f"{name}: {result['descriptions'][name]}", format_table(headers, rows), ""]
        fcfs, fair = runs["fcfs"], runs["fair"]
        summary.append(
            [
                name,
                fcfs["throughput_tokens_per_s"],
                fair["throughput_tokens_per_s"],
                format_ratio(ratio(fair["throughput_tokens_per_s"], fcfs["throughput_tokens_per_s"])),
                fcfs["max_weighted_gap"],
                fair["max_weighted_gap"],
                fair["bound"],
                "yes" if fair["max_weighted_gap"] <= fair["bound"] else "NO",
            ]
        )
    headers = [
        "workload",
        "fcfs out tok/s",
        "fair out tok/s",
        "fair/fcfs",
        "fcfs max gap",
        "fair max gap",
        "bound",
        "fair within bound",
    ]
    engine = result["engine"]
    lines += [
        f"engine: {engine['device']} {engine['dtype']}, {engine['max_num_seqs']} running sequences at most, "
        f"KV pool {engine['kv_pool_tokens']} tokens; shares over the steps in which every tenant was "
        "backlogged; gaps in weighted cost units",
        format_table(headers, summary),
    ]
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    if args.seconds is not None and args.seconds <= 0:
        raise SystemExit("weir bench fairness: error: --seconds must be positive")
    if args.steps is not None and args.steps < 1:
        raise SystemExit("weir bench fairness: error: --steps must be at least 1")


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    publish(run(args), args.out, render)
    return 0
