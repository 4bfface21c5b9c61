"""The telemetry benchmark's statistics: the median ratio's confidence interval and the verdict."""

from __future__ import annotations

import random

from bench.telemetry_overhead import FIGURES, _medians, _ratios, median_interval, render


def test_median_interval_is_the_binomial_order_statistics():
    values = [float(v) for v in range(1, 13)]
    random.Random(0).shuffle(values)
    assert median_interval(values, 0.95) == (3.0, 10.0)  # 2 P(Bin(12, 1/2) <= 2) = 3.9 % <= 5 %
    assert median_interval([float(v) for v in range(1, 17)], 0.95) == (4.0, 13.0)
    assert median_interval([2.0, 1.0, 3.0], 0.95) == (1.0, 3.0)  # too few rounds: the whole range


def _run(tok_s: float, ttft: float) -> dict:
    return {
        "output_tokens_per_s": tok_s,
        "ttft_ms": {"p50": ttft},
        "tpot_ms": {"p50": 100.0},
        "cpu_ms_per_output_token": 1000 / tok_s,
        "cpu_ms_per_request": 500.0,
        "completed": 16,
    }


def _result(off: list[dict], on: list[dict]) -> dict:
    runs = {"off": off, "on": on}
    return {
        "runs": runs,
        "medians": {mode: _medians(runs[mode]) for mode in runs},
        "ratios": {name: _ratios(runs, read) for name, read in FIGURES.items()},
        "otlp_spans_received": 10,
        "kernels": {"off": "float32, products by onednn", "on": "float32, products by onednn"},
        "otlp_metrics_received": ["m"],
        "telemetry_cpu_us_per_request": {"off": 1.0, "on": 2.0},
        "telemetry_share_of_request_cpu_pct": 0.1,
    }


def test_verdict_from_the_rounds_ratios():
    # the rounds differ by far more than the modes do: pairing within the round is what tells them apart
    off = [_run(tok, 1000.0 * tok / 40) for tok in (30.0, 40.0, 35.0, 45.0, 38.0, 33.0, 42.0, 36.0)]
    close = [_run(r["output_tokens_per_s"] * 0.995, r["ttft_ms"]["p50"] * 1.005) for r in off]
    far = [_run(r["output_tokens_per_s"] * 0.95, r["ttft_ms"]["p50"] * 1.05) for r in off]
    met = render(_result(off, close))
    assert "output tokens/s -0.50 %, TTFT p50 +0.50 % (target: both within 2 %: met)" in met
    assert "output tokens/s -0.50 % to -0.50 %, inside the target" in met
    missed = render(_result(off, far))
    assert "(target: both within 2 %: not met)" in missed
    assert "TTFT p50 +5.00 % to +5.00 %, beyond the target" in missed
