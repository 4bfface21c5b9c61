"""The telemetry benchmark's statistics: the intervals of its ratios and the verdict."""

from __future__ import annotations

import random

from bench.paired_rounds import median_interval, percentile, pooled_ratio
from bench.telemetry_overhead import FIGURES, _medians, _ratios, _steady_ttft, render


def test_median_interval_is_the_binomial_order_statistics():
    values = [float(v) for v in range(1, 13)]
    random.Random(0).shuffle(values)
    assert median_interval(values, 0.95) == (3.0, 10.0)  # 2 P(Bin(12, 1/2) <= 2) = 3.9 % <= 5 %
    assert median_interval([float(v) for v in range(1, 17)], 0.95) == (4.0, 13.0)
    assert median_interval([2.0, 1.0, 3.0], 0.95) == (1.0, 3.0)  # too few rounds: the whole range


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 90) == 5.0
    assert percentile([0.0, 10.0], 90) == 9.0


def test_pooled_ratio_resamples_whole_rounds():
    rng = random.Random(3)
    base = [[rng.uniform(50, 500) for _ in range(32)] for _ in range(20)]
    same = pooled_ratio(base, [list(r) for r in base], 50, 0.95)
    assert same["ratio"] == 1.0 and same["interval"] == [1.0, 1.0]  # identical rounds: no spread at all
    slower = [[v * 1.1 for v in r] for r in base]
    scaled = pooled_ratio(base, slower, 50, 0.95)
    assert abs(scaled["ratio"] - 1.1) < 1e-9 and all(abs(b - 1.1) < 1e-9 for b in scaled["interval"])
    noisy = [[v * rng.uniform(0.7, 1.4) for v in r] for r in base]
    spread = pooled_ratio(base, noisy, 50, 0.95)
    low, high = spread["interval"]
    assert low < spread["ratio"] < high and high - low > 0.02  # per-request noise widens it
    assert spread["base"] == percentile([v for r in base for v in r], 50)


def _run(tok_s: float, ttft: float, steady: list[float]) -> dict:
    return {
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": ttft},
        "tpot_ms": {"p50": 100.0},
        "cpu_ms_per_output_token": 1000 / tok_s,
        "cpu_ms_per_request": 500.0,
        "completed": 16,
        "steady_ttft_ms": steady,
    }


def _result(off: list[dict], on: list[dict]) -> dict:
    runs = {"off": off, "on": on}
    return {
        "workload": {"rate_rps": 8.0, "steady_rate_rps": 1.5},
        "runs": runs,
        "medians": {mode: _medians(runs[mode]) for mode in runs},
        "ratios": {name: _ratios(runs, read) for name, read in FIGURES.items()},
        "steady_ttft": _steady_ttft(runs),
        "otlp_spans_received": 10,
        "kernels": {"off": "float32, products by onednn", "on": "float32, products by onednn"},
        "otlp_metrics_received": ["m"],
        "telemetry_cpu_us_per_request": {"off": 1.0, "on": 2.0},
        "telemetry_share_of_request_cpu_pct": 0.1,
    }


def _scaled(runs: list[dict], tok: float, ttft: float, steady: float) -> list[dict]:
    return [
        _run(
            r["output_tokens_per_s"] * tok,
            r["ttft_ms"]["p50"] * ttft,
            [v * steady for v in r["steady_ttft_ms"]],
        )
        for r in runs
    ]


def test_verdict_from_throughput_and_the_steady_loads_ttft():
    # the rounds differ by far more than the modes do: pairing within the round is what tells them apart
    steady = [[100.0 + 7 * i + j for j in range(9)] for i in range(8)]
    tok_s = (30.0, 40.0, 35.0, 45.0, 38.0, 33.0, 42.0, 36.0)
    off = [_run(tok, 1000.0 * tok / 40, steady[i]) for i, tok in enumerate(tok_s)]
    met = render(_result(off, _scaled(off, 0.995, 1.3, 1.005)))
    # the overloaded load's TTFT is shown but not judged; the steady load's is
    assert (
        "output tokens/s -0.50 %, TTFT p50 at 1.5 req/s +0.50 % (72 requests; target: both within 2 %: met)"
        in met
    )
    assert "TTFT p50 at 8 req/s +30.00 %" in met
    assert "output tokens/s -0.50 % to -0.50 %, inside the target" in met
    assert "TTFT p50 at 1.5 req/s +0.50 % to +0.50 %, inside the target" in met
    missed = render(_result(off, _scaled(off, 0.995, 1.0, 1.05)))
    assert "(72 requests; target: both within 2 %: not met)" in missed
    assert "TTFT p50 at 1.5 req/s +5.00 % to +5.00 %, beyond the target" in missed
    slower = render(_result(off, _scaled(off, 0.95, 1.0, 1.0)))
    assert "target: both within 2 %: not met" in slower
