"""The step-time model behind the engine's time-to-first-token estimate."""

from __future__ import annotations

import pytest

from engine.step_time import DEFAULT_OVERHEAD_S, StepTimeModel


def test_fit_recovers_overhead_and_per_token_cost() -> None:
    model = StepTimeModel()
    for n in (1, 32, 512, 8, 300, 64) * 3:
        model.observe(n, 0.01 + 0.001 * n)
    assert model.overhead == pytest.approx(0.01) and model.per_token == pytest.approx(0.001)
    # 1000 prompt tokens next to 12 decodes at 512 tokens a step: two steps
    assert model.time_for(1000, 12, 512) == pytest.approx(2 * 0.01 + 0.001 * (1000 + 2 * 12))
    assert model.time_for(0, 12, 512) == 0.0


def test_one_step_size_scales_the_token_cost_and_recent_steps_weigh_more() -> None:
    model = StepTimeModel(decay=0.5)
    model.observe(100, DEFAULT_OVERHEAD_S + 0.5)
    assert model.overhead == DEFAULT_OVERHEAD_S and model.per_token == pytest.approx(0.005)
    for _ in range(30):  # the machine got 10x slower
        model.observe(100, 0.1)
        model.observe(400, 0.4)
    assert model.per_token == pytest.approx(0.001, rel=1e-3) and model.overhead == pytest.approx(0, abs=1e-6)
