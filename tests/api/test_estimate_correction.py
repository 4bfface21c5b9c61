"""What admission multiplies the TTFT estimate by before it meets a target: the tail of its recent error."""

from __future__ import annotations

import pytest

from api.admission import MAX_ESTIMATE_CORRECTION, _estimate_correction
from engine.types import EngineStats, TTFTEstimate


def _stats(p50: float | None, p95: float | None) -> EngineStats:
    return EngineStats(
        running=0,
        waiting=0,
        kv_blocks_total=8,
        kv_blocks_free=8,
        block_size=16,
        tokens_per_s=0.0,
        prompt_tokens_per_s=0.0,
        steps=0,
        preemptions=0,
        ttft_estimate_ratio_p50=p50,
        ttft_estimate_ratio_p95=p95,
    )


def _estimate(tenant_tail: float | None) -> TTFTEstimate:
    return TTFTEstimate(seconds=1.0, queued_tokens=0, reliable=True, tenant_ratio_tail=tenant_tail)


def test_the_tenants_own_tail_wins_over_the_engines():
    assert _estimate_correction(_stats(1.1, 1.3), _estimate(1.6)) == pytest.approx(1.6)


def test_without_the_tenants_own_the_engines_95th_percentile_is_used_not_its_median():
    assert _estimate_correction(_stats(1.1, 1.3), _estimate(None)) == pytest.approx(1.3)


def test_right_after_a_start_with_too_few_errors_for_a_tail_the_engines_median_is_used():
    assert _estimate_correction(_stats(1.4, None), _estimate(None)) == pytest.approx(1.4)


def test_an_estimate_that_runs_long_is_not_scaled_down_and_the_correction_is_capped():
    assert _estimate_correction(_stats(0.5, 0.8), _estimate(None)) == 1.0
    assert _estimate_correction(_stats(None, None), _estimate(None)) == 1.0
    assert _estimate_correction(_stats(5.0, 9.0), _estimate(None)) == MAX_ESTIMATE_CORRECTION
