"""The roofline's ideal schedule: it computes exactly the workload's FLOPs, reads the weights once a step,
and respects the engine's limits."""

from __future__ import annotations

import pytest

from bench.ceiling import ModelShape, workload_flops
from bench.roofline import Machine, StepWork, ideal_steps, kv_bytes_per_token, roofline_seconds, weight_bytes

SHAPE = ModelShape(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100)
LENGTHS = [(7, 5), (20, 1), (3, 9), (40, 2)]


def steps(**limits) -> list[StepWork]:
    options = dict(max_num_seqs=2, max_batched_tokens=16, prefill_chunk_size=8, bytes_per_value=4)
    return ideal_steps(SHAPE, LENGTHS, **{**options, **limits})


def test_the_steps_compute_exactly_the_workloads_flops() -> None:
    for limits in ({}, {"max_num_seqs": 64, "max_batched_tokens": 512, "prefill_chunk_size": 256}):
        assert sum(s.flops for s in steps(**limits)) == workload_flops(SHAPE, LENGTHS)


def test_each_step_reads_the_weights_once_and_the_kv_it_attends() -> None:
    one = ideal_steps(
        SHAPE, [(4, 2)], max_num_seqs=1, max_batched_tokens=16, prefill_chunk_size=16, bytes_per_value=2
    )
    weights, kv = weight_bytes(SHAPE, 2), kv_bytes_per_token(SHAPE, 2)
    assert [s.bytes for s in one] == [weights + 4 * kv, weights + 5 * kv]  # prefill of 4, one decode
    assert weights == 2 * (3 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48) + 32 * 100)


def test_fewer_running_places_mean_more_steps_and_a_higher_roofline() -> None:
    machine = Machine(flops_per_s=1e9, bytes_per_s=1e9)
    narrow, wide = steps(max_num_seqs=1), steps(max_num_seqs=4)
    assert len(narrow) > len(wide)
    assert roofline_seconds(narrow, machine) > roofline_seconds(wide, machine)
    step = StepWork(flops=3_000, bytes=1_000)
    assert step.seconds(Machine(flops_per_s=1_000, bytes_per_s=1_000)) == pytest.approx(3.0)
    assert step.seconds(Machine(flops_per_s=1e6, bytes_per_s=100)) == pytest.approx(10.0)
