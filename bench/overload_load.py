"""The overload benchmark's traffic: three tenants' Poisson streams at multiples of their share of the
capacity, what each tenant got from them, and the capacity search.

A tenant's share of the capacity is a third of it. The loads: each tenant at 1x, 2x and 3x its share, and
``noisy``, one tenant at 5x its share while the two others send 0.8 of theirs, for twice as long.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from bench.http_load import LoadRequest, run_load
from bench.latency import RequestRecord, ms, percentile, summarize
from bench.serve import build_load
from bench.workload import WorkloadSpec, derived_seed

TENANTS = ("a", "b", "c")


@dataclass(frozen=True)
class Load:
    multiples: tuple[float, float, float]  # each tenant's rate as a multiple of its share
    length: float = 1.0  # of the benchmark's load duration: the light tenants of ``noisy`` need longer


LOADS = {
    "1x": Load((1.0, 1.0, 1.0)),
    "2x": Load((2.0, 2.0, 2.0)),
    "3x": Load((3.0, 3.0, 3.0)),
    "noisy": Load((5.0, 0.8, 0.8), length=2.0),
}
SHAPE = WorkloadSpec(prompt_len=(16, 64), output_len=(8, 16))
BURST = 4  # requests per tenant sent at once to gauge the throughput
CAPACITY_STEP = 1.5  # the factor between trials until one meets the target and one misses it
CAPACITY_PRECISION = 1.1  # the search ends when the rate that missed is within this factor of the one met
CAPACITY_TRIALS = 7  # at most


@dataclass
class Bracket:
    """The capacity search's bracket: the highest rate that met the target and the lowest that missed."""

    met: float | None = None
    missed: float | None = None

    def next_rate(self, rate: float, ok: bool) -> float | None:
        """Record a load at ``rate``; the next rate to try, or None once the bracket is within
        ``CAPACITY_PRECISION``."""
        if ok:
            self.met = rate if self.met is None else max(self.met, rate)
        else:
            self.missed = rate if self.missed is None else min(self.missed, rate)
        if self.met is None:
            return self.missed / CAPACITY_STEP
        if self.missed is None:
            return self.met * CAPACITY_STEP
        if self.missed / self.met <= CAPACITY_PRECISION:
            return None
        return (self.met * self.missed) ** 0.5


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def tenant_load(
    tokenizer, keys: Sequence[str | None], rates: Sequence[float], seconds: float, seed: int, index: int
) -> list[LoadRequest]:
    """Each tenant's Poisson stream at its rate (req/s) for about ``seconds``, merged in time order; load
    number ``index`` draws prompts of its own, and every tenant has its own arrival pattern."""
    load: list[LoadRequest] = []
    for tenant, (key, rate) in enumerate(zip(keys, rates, strict=True)):
        spec = replace(SHAPE, num_requests=max(1, round(rate * seconds)), seed=derived_seed(seed, tenant))
        load += build_load(tokenizer, spec, rate, [key], index)
    return sorted(load, key=lambda request: request.at)


def tenant_figures(
    records: Sequence[RequestRecord], slo: Slo, seconds: float, light: bool
) -> dict[str, object]:
    """What one tenant got: goodput over ``seconds``, SLO attainment of its admitted requests, the share
    refused, TTFT/TPOT percentiles (ms) of the admitted ones, refusals by status and error code, and the
    admitted ones that failed (transport errors, error events) by what the client saw."""
    admitted = [r for r in records if not r.refused]
    good = sum(r.meets(slo.ttft_s, slo.tpot_s) for r in admitted if r.ok)
    latency = summarize(admitted, slo.ttft_s, slo.tpot_s) if admitted else None
    refusals = Counter(f"{r.status} {r.refusal or '-'}" for r in records if r.refused)
    return {
        "light": light,
        "slo_attainment": round(good / len(admitted), 4) if admitted else None,
        "refused_share": round((len(records) - len(admitted)) / len(records), 4) if records else 0.0,
        "ttft_p99_ms": latency["ttft_ms"]["p99"] if latency else None,
        "goodput_rps": round(good / seconds, 4),
        "ttft_p50_ms": latency["ttft_ms"]["p50"] if latency else None,
        "tpot_p50_ms": latency["tpot_ms"]["p50"] if latency else None,
        "tpot_p99_ms": latency["tpot_ms"]["p99"] if latency else None,
        "requests": len(records),
        "admitted": len(admitted),
        "failed": sum(1 for r in admitted if not r.ok),
        "failures": dict(Counter(r.error or f"status {r.status}" for r in admitted if not r.ok)),
        "refusals": dict(sorted(refusals.items())),
    }


def refusal_latency_p99_ms(records: Sequence[RequestRecord]) -> float | None:
    """The 99th percentile of how long refused requests waited for their answer."""
    return ms(percentile([r.done - r.sent for r in records if r.refused and r.done is not None], 99))


async def measure_capacity(
    base_url: str,
    model: str,
    keys: Sequence[str | None],
    tokenizer,
    slo: Slo,
    seconds: float,
    seed: int,
    report: Callable[[str], None],
) -> dict:
    """The total request rate the server carries with TTFT p99 within the target and nothing refused.

    First a burst of ``BURST`` requests per tenant, sent at once, gauges the throughput; then Poisson loads
    of ``seconds``, the three tenants sharing each rate evenly, bracket the capacity: from the burst's
    rate up or down by ``CAPACITY_STEP`` until one load meets the target and another misses it, then
    halving the bracket (geometrically) until the rate missed is within ``CAPACITY_PRECISION`` of the rate
    met, in at most ``CAPACITY_TRIALS`` loads. The capacity is the highest rate met (the lowest tried when
    none met); ``missed_at_rps`` the lowest rate missed.
    """
    burst = [
        replace(r, at=0.0) for r in tenant_load(tokenizer, keys, [BURST / seconds] * 3, seconds, seed, 0)
    ]
    records = await run_load(base_url, model, burst)
    ended = [r.done for r in records if r.ok]
    if not ended:
        raise RuntimeError("no request of the capacity burst completed")
    throughput = len(ended) / (max(ended) - min(r.sent for r in records))
    report(f"capacity: a burst of {len(burst)} requests ran at {throughput:.3f} req/s")
    trials: list[dict] = []
    bracket = Bracket()
    rate: float | None = throughput
    for index in range(1, CAPACITY_TRIALS + 1):
        load = tenant_load(tokenizer, keys, [rate / 3] * 3, seconds, seed, index)
        records = await run_load(base_url, model, load)
        admitted = [r for r in records if r.ok]
        p99 = percentile([r.ttft for r in admitted if r.ttft is not None], 99)
        refused = sum(r.refused for r in records)
        ok = refused == 0 and len(admitted) == len(records) and p99 is not None and p99 <= slo.ttft_s
        trials.append({"rate_rps": round(rate, 4), "ttft_p99_ms": ms(p99), "refused": refused, "met": ok})
        report(f"capacity: {rate:.3f} req/s: TTFT p99 {ms(p99)} ms, {refused} refused")
        rate = bracket.next_rate(rate, ok)
        if rate is None:
            break
    capacity = bracket.met if bracket.met is not None else min(t["rate_rps"] for t in trials)
    return {
        "capacity_rps": round(capacity, 4),
        "missed_at_rps": None if bracket.missed is None else round(bracket.missed, 4),
        "burst_rps": round(throughput, 4),
        "trials": trials,
    }
