"""The step-time model behind the engine's time-to-first-token estimate."""

from __future__ import annotations

import pytest

from engine.step_time import HALF_LIFE_S, StepSample, StepTimeModel

# An idle engine's measured costs in these tests: 10 ms a step, 1 ms a prompt token, 2 ms a decode.
IDLE = (0.010, 0.001, 0.002)


def step_seconds(prefill: int, decodes: int, costs: tuple[float, float, float] = IDLE) -> float:
    return costs[0] + costs[1] * prefill + costs[2] * decodes


def calibrated() -> StepTimeModel:
    model = StepTimeModel()
    shapes = ((16, 0), (64, 0), (256, 0), (0, 1), (0, 16))
    model.calibrate(StepSample(p, d, step_seconds(p, d)) for p, d in shapes)
    return model


def test_calibration_gives_the_three_costs_and_a_reliable_estimate() -> None:
    costs = calibrated().costs()
    assert costs.reliable
    assert (costs.overhead, costs.per_prefill_token, costs.per_decode) == pytest.approx(IDLE, rel=1e-3)
    # 1000 prompt tokens beside 12 decodes in steps of 512 tokens: two steps
    assert costs.prefill_seconds(1000, 12, 512) == pytest.approx(2 * (0.010 + 0.024) + 1.0, rel=1e-3)
    assert costs.prefill_seconds(0, 12, 512) == 0.0


def test_recent_steps_of_several_shapes_are_fitted_without_a_calibration() -> None:
    model = StepTimeModel()
    now = 100.0
    for i, (p, d) in enumerate(((1, 0), (32, 4), (512, 0), (8, 30), (300, 2), (0, 12)) * 3):
        model.observe(p, d, step_seconds(p, d), now + 0.01 * i)
    costs = model.costs(now + 0.2)
    assert costs.reliable
    assert (costs.overhead, costs.per_prefill_token, costs.per_decode) == pytest.approx(IDLE, rel=1e-2)


def test_decode_only_steps_are_not_extrapolated_to_prefill() -> None:
    """After one request on a fresh engine: only one-token decode steps of 60 ms each have been seen."""
    fresh = StepTimeModel()
    for i in range(7):
        fresh.observe(0, 1, 0.060, 10.0 + 0.06 * i)
    assert not fresh.costs(10.5).reliable  # steps of one size: this estimate may not shed

    model = calibrated()
    for i in range(200):  # a long, slow decode-only stretch (the machine is busy)
        model.observe(0, 1, 0.060, 10.0 + 0.06 * i)
    costs = model.costs(22.0)
    assert costs.reliable
    assert costs.step_seconds(0, 1) == pytest.approx(0.060, rel=0.1)  # decodes follow what was seen
    assert costs.per_prefill_token <= IDLE[1] * 1.05  # prompt tokens do not inherit the decode time
    assert costs.prefill_seconds(50, 0, 512) < 0.2


def test_a_burst_does_not_outlive_itself() -> None:
    model = calibrated()
    slow = tuple(5 * c for c in IDLE)  # the machine is five times slower during a burst
    now = 1000.0
    for i, (p, d) in enumerate(((256, 8), (16, 30), (128, 2), (0, 24)) * 50):
        model.observe(p, d, step_seconds(p, d, slow), now + 0.05 * i)
    burst_end = now + 10.0
    during = model.costs(burst_end)
    assert during.prefill_seconds(512, 0, 512) == pytest.approx(step_seconds(512, 0, slow), rel=0.15)
    later = model.costs(burst_end + 12 * HALF_LIFE_S)  # idle since
    assert later.prefill_seconds(512, 0, 512) == pytest.approx(step_seconds(512, 0), rel=0.05)


def test_recent_steps_fade_to_unreliable_without_a_calibration() -> None:
    model = StepTimeModel()
    for i, p in enumerate((16, 256, 64, 512) * 4):
        model.observe(p, 0, step_seconds(p, 0), 50.0 + 0.1 * i)
    assert model.costs(52.0).reliable
    assert not model.costs(52.0 + 10 * HALF_LIFE_S).reliable
