"""The capacity plan's math: step times read from a profile, the simulated schedule, capacity and N+1."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine.capacity_plan import (
    EngineLimits,
    HostCost,
    Lengths,
    Mix,
    Plan,
    Simulation,
    StepProfile,
    Targets,
    capacity,
    make_plan,
    simulate,
)

LIMITS = EngineLimits(max_batched_tokens=512, max_num_seqs=64, prefill_chunk_size=256, kv_tokens=100_000)


def linear_profile(
    overhead: float = 0.01, per_token: float = 0.001, per_decode: float = 0.002, load_s: float = 10.0
) -> StepProfile:
    """A profile whose steps take ``overhead + per_token * P + per_decode * D`` exactly."""
    rows, columns = (0, 64, 256), (0, 1, 8)
    seconds = [[overhead + per_token * p + per_decode * d for d in columns] for p in rows]
    seconds[0][0] = None
    return StepProfile.from_grid(rows, columns, seconds, 64, (8, [64, 256], [0.02, 0.02]), LIMITS, load_s)


def test_step_times_are_interpolated_within_the_grid_and_extended_beyond_it():
    profile = linear_profile()
    assert profile.seconds[0][0] == pytest.approx(0.01)  # the empty step: the overhead, extrapolated
    assert profile.step_seconds(100, 3) == pytest.approx(0.01 + 0.1 + 0.006)
    assert profile.step_seconds(512, 32) == pytest.approx(0.01 + 0.512 + 0.064)  # beyond the grid
    assert profile.step_seconds(0, 0) == 0
    assert profile.per_context_token == 0  # the sweep was flat


def test_the_context_term_adds_the_sweeps_slope_per_token_beyond_the_grids_context():
    rows, columns = (0, 64), (0, 1)
    # 4 decodes at 100 then 300 tokens of context each: 800 more context tokens took 0.02 s more
    sweep = (4, [100, 300], [0.01, 0.03])
    profile = StepProfile.from_grid(rows, columns, [[None, 0.01], [0.05, 0.06]], 100, sweep, LIMITS, 1.0)
    assert profile.per_context_token == pytest.approx(0.02 / 800)
    # two decodes at 400 tokens each: 600 context tokens beyond the grid's 100 each
    assert profile.step_seconds(0, 2, context_tokens=800) == pytest.approx(profile.step_seconds(0, 2) + 0.015)


def test_an_incomplete_grid_is_refused():
    with pytest.raises(ValueError, match="measured time"):
        StepProfile.from_grid(
            (0, 64), (0, 1), [[None, 0.01], [None, 0.06]], 64, (1, [64], [0.01]), LIMITS, 1.0
        )
    with pytest.raises(ValueError, match="start at 0"):
        StepProfile.from_grid(
            (16, 64), (0, 1), [[0.1, 0.01], [0.1, 0.06]], 64, (1, [64], [0.01]), LIMITS, 1.0
        )


def test_lengths_parse_each_form_and_refuse_the_rest():
    assert Lengths.parse("128") == Lengths(128, 128)
    assert Lengths.parse("16-64").mean == 40
    assert Lengths.parse("8,32").values == (8, 32)
    for bad in ("0", "64-16", "a-b", ""):
        with pytest.raises(ValueError):
            Lengths.parse(bad)


def test_a_lone_request_takes_its_prefill_step_then_one_decode_step_per_token():
    profile = linear_profile()
    mix = Mix(Lengths(100, 100), Lengths(5, 5))
    alone = simulate(profile, mix, rate=1e-6, targets=Targets(10, 10), requests=30)
    assert alone.ttft_p == pytest.approx(0.01 + 0.1)  # one prefill step of 100 tokens
    assert alone.tpot_p == pytest.approx(0.01 + 0.002)  # each further token: a decode step of one
    assert alone.peak_kv_tokens == 100 + 5 - 1  # the last token is sampled, never computed


def test_a_long_prompt_is_prefilled_in_chunks():
    profile = linear_profile()
    alone = simulate(profile, Mix(Lengths(600, 600), Lengths(1, 1)), 1e-6, Targets(10, 10), requests=20)
    assert alone.ttft_p == pytest.approx(3 * 0.01 + 0.6)  # chunks of 256, 256 and 88 tokens


def test_latency_grows_with_the_rate_and_capacity_falls_with_longer_prompts():
    profile = linear_profile()
    mix, targets = Mix(Lengths(64, 256), Lengths(8, 32)), Targets(1.0, 0.2)
    figures = [simulate(profile, mix, rate, targets, requests=300) for rate in (1, 4, 8)]
    assert figures[0].ttft_p <= figures[1].ttft_p <= figures[2].ttft_p
    short = capacity(profile, mix, targets, requests=300)
    long = capacity(profile, Mix(Lengths(256, 768), Lengths(8, 32)), targets, requests=300)
    assert short.meets(targets) and long.meets(targets)
    assert 0 < long.rate < short.rate
    just_above = simulate(profile, mix, short.rate * 1.05, targets, requests=300)
    assert not just_above.meets(targets)


def test_capacity_is_zero_when_a_lone_request_misses_its_target():
    profile = linear_profile()
    mix = Mix(Lengths(1000, 1000), Lengths(4, 4))
    assert capacity(profile, mix, Targets(0.5, 1.0), requests=50).rate == 0
    with pytest.raises(ValueError, match="no number of replicas"):
        make_plan(profile, mix, Targets(0.5, 1.0), rate=1.0)


def test_n_plus_one_carries_the_rate_with_one_replica_down_during_the_replacements_load():
    replica = Simulation(rate=1.0, ttft_p=0.5, tpot_p=0.1, peak_kv_tokens=0)
    plan = Plan(rate=2.5, replica=replica, failures=1, load_s=30.0, kv_tokens=1000)
    assert plan.replicas == 3 and plan.replicas_with_spares == 4
    assert plan.utilization(3) == pytest.approx(2.5 / 3) and plan.utilization(4) == pytest.approx(2.5 / 4)
    assert plan.spare_rps == 1.0
    assert plan.excess_without_spares_rps == pytest.approx(0.5)  # 2 survivors carry 2 of the 2.5 req/s
    assert plan.excess_requests == pytest.approx(15.0)  # for the 30 s the replacement loads
    exact = Plan(rate=3.0, replica=replica, failures=2, load_s=10.0, kv_tokens=1000)
    assert exact.replicas == 3 and exact.replicas_with_spares == 5
    assert exact.excess_without_spares_rps == pytest.approx(2.0)


def test_more_traffic_never_needs_fewer_replicas():
    profile = linear_profile()
    mix, targets = Mix(Lengths(64, 256), Lengths(8, 32)), Targets(1.0, 0.2)
    counts = [make_plan(profile, mix, targets, rate, requests=200).replicas for rate in (1, 10, 40, 100)]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_capacity_never_exceeds_what_a_replica_serves_with_every_request_arriving_at_once():
    profile = linear_profile()
    mix, loose = Mix(Lengths(64, 256), Lengths(8, 32)), Targets(1e6, 1e6)
    flat_out = simulate(profile, mix, 1e12, loose, requests=100).served_rps
    assert 0 < capacity(profile, mix, loose, requests=100).rate == flat_out


def test_host_work_stretches_every_step_by_the_cores_it_leaves_the_engine():
    host = HostCost(cores=2, request_s=0.01, token_s=0.001)
    # 50 req/s of 10-token outputs keep 50 * 0.02 = 1 core busy: the engine has half the machine
    assert host.busy_cores(50, 10) == pytest.approx(1.0)
    assert host.stretch(50, 10) == pytest.approx(2.0)
    assert host.stretch(0, 10) == 1.0
    assert host.max_rate(10) == pytest.approx(100)
    assert host.stretch(100, 10) == math.inf
    both = host.plus(HostCost(cores=2, request_s=0.005, token_s=0.0))
    assert both.request_s == pytest.approx(0.015) and both.token_s == pytest.approx(0.001)
    alone = simulate(
        linear_profile(), Mix(Lengths(64, 64), Lengths(10, 10)), 1e-6, Targets(5, 5), requests=20
    )
    busy = simulate(
        replace(linear_profile(), host=host), Mix(Lengths(64, 64), Lengths(10, 10)), 50, Targets(5, 5), 20
    )
    assert busy.tpot_p >= 2 * alone.tpot_p * 0.999  # every step twice as long, and batched with others


def test_host_work_lowers_capacity_and_caps_it_below_the_rate_the_host_alone_saturates():
    mix, targets = Mix(Lengths(16, 64), Lengths(8, 16)), Targets(2.0, 0.2)
    rates = [
        capacity(replace(linear_profile(), host=HostCost(2, request_s, 0.0)), mix, targets, 200).rate
        for request_s in (0.0, 0.01, 0.05)
    ]
    assert rates[0] > rates[1] > rates[2] > 0
    loose = Targets(1e6, 1e6)
    heavy = replace(linear_profile(), host=HostCost(2, 0.2, 0.0))  # the host alone saturates at 10 req/s
    flat_out = simulate(linear_profile(), mix, 1e12, loose, requests=100).served_rps
    served = capacity(heavy, mix, loose, requests=100).rate
    assert served == pytest.approx(flat_out / (1 + flat_out / 10))
    assert served < 10
