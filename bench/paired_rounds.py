"""Confidence intervals for a benchmark that runs the same load on two servers, round by round.

Two estimates of "how much slower is B than A", each with a 95 % (or other) interval:

- ``median_interval`` over the rounds' own ratios: right for a figure that is steady within a round
  (throughput), where pairing the two servers in each round cancels the machine's slow drifts.
- ``pooled_ratio``: the ratio of one percentile over all rounds' requests pooled, with an interval from
  resampling whole rounds (both servers' requests of a round stay together). Right for a per-request
  latency, whose percentile in one round of a few dozen requests jumps between neighbouring requests
  (one round's TTFT p50 moved by 10-30 % between identical servers).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from bench.latency import percentile

RESAMPLES = 2000  # of the round bootstrap


def median_interval(values: list[float], confidence: float) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: the order statistics ``x(k)`` and
    ``x(n+1-k)`` with the largest ``k`` for which the binomial(n, 1/2) chance of falling outside them stays
    within ``1 - confidence``; the whole range when there are too few values for that."""
    ordered, n = sorted(values), len(values)
    k = 0
    while k + 1 <= n // 2:
        outside = 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n  # beyond x(k+1)..x(n-k)
        if outside > 1 - confidence:
            break
        k += 1
    if k == 0:
        return ordered[0], ordered[-1]
    return ordered[k - 1], ordered[n - k]


def _percentile(values: Sequence[float], pct: float) -> float:
    value = percentile(values, pct)
    if value is None:
        raise ValueError("no values")
    return value


def pooled_ratio(
    base: Sequence[Sequence[float]],
    other: Sequence[Sequence[float]],
    pct: float,
    confidence: float,
    seed: int = 0,
) -> dict:
    """``percentile(other pooled) / percentile(base pooled)`` over rounds of per-request values, and a
    percentile-bootstrap interval of it that resamples rounds (each round's two lists together)."""
    if len(base) != len(other) or not base:
        raise ValueError("need the same, non-zero number of rounds on both sides")

    def ratio(rounds: Sequence[int]) -> float:
        pooled_base = [v for r in rounds for v in base[r]]
        pooled_other = [v for r in rounds for v in other[r]]
        return _percentile(pooled_other, pct) / _percentile(pooled_base, pct)

    everything = range(len(base))
    rng = random.Random(seed)
    draws = sorted(ratio(rng.choices(everything, k=len(base))) for _ in range(RESAMPLES))
    tail = (1 - confidence) / 2
    return {
        "base": _percentile([v for r in base for v in r], pct),
        "other": _percentile([v for r in other for v in r], pct),
        "ratio": ratio(everything),
        "interval": [_percentile(draws, 100 * tail), _percentile(draws, 100 * (1 - tail))],
    }
