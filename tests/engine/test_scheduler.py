"""Step planning: token budget, chunked prefill, decodes first, preemption, rejection (no model needed)."""

from __future__ import annotations

import itertools
import time

import pytest

from engine.batch import StepBatch
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.policies import FCFSPolicy, make_policy
from engine.scheduler import MIN_PREFILL_TOKENS, TPOT_HEADROOM, Scheduler, StepPlan
from engine.sequence import Sequence, SequenceStatus
from engine.step_time import StepCosts
from engine.types import SamplingParams
from tests.engine.engine_helpers import run_plan


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, prefill_budget=None, max_model_len: int | None = None, **limits
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size)
    limits.setdefault("max_num_seqs", min(EngineConfig.max_num_seqs, limits.get("max_batched_tokens", 512)))
    return Scheduler(
        kv,
        FCFSPolicy(),
        EngineConfig(block_size=block_size, **limits),
        max_model_len=max_model_len or kv.capacity_tokens,
        prefill_budget=prefill_budget,
    )


_first_tokens = itertools.count(1, 10_000)


def add(scheduler: Scheduler, request_id: str, prompt_len: int, arrival: float) -> Sequence:
    """A request whose prompt shares no prefix with any other (the prefix cache plays no part)."""
    start = next(_first_tokens)
    seq = Sequence(request_id, list(range(start, start + prompt_len)), SamplingParams(), arrival_time=arrival)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> tuple[StepPlan, StepBatch | None]:
    """Run a planned step (``run_plan``) and append a made-up token to every sequence whose logits it
    yields."""
    plan, batch = run_plan(scheduler)
    for seq in plan.sample_seqs:
        scheduler.append_token(seq, 7)
    return plan, batch


def test_long_prompt_is_prefilled_in_chunks_and_sampled_only_at_its_end() -> None:
    scheduler = make_scheduler(prefill_chunk_size=16, max_batched_tokens=512)
    seq = add(scheduler, "a", 40, 0.0)
    lens = []
    for _ in range(3):
        plan, batch = step(scheduler)
        lens.append(batch.query_lens)
        assert plan.sample_seqs == ([seq] if seq.num_output_tokens else [])
    assert lens == [[16], [16], [8]]
    assert batch.positions.tolist() == list(range(32, 40))
    assert batch.context_lens == [40] and batch.logits_indices.tolist() == [7]
    _, decode = step(scheduler)
    assert decode.query_lens == [1] and decode.num_decodes == 1 and decode.positions.tolist() == [40]


def test_decodes_go_first_and_the_budget_caps_prefill() -> None:
    scheduler = make_scheduler(prefill_chunk_size=16, max_batched_tokens=20)
    short = add(scheduler, "short", 3, 0.0)
    step(scheduler)
    assert short.num_output_tokens == 1
    long = add(scheduler, "long", 100, 1.0)
    plan, batch = step(scheduler)
    assert batch.query_lens == [1, 16] and batch.num_decodes == 1
    assert plan.sample_seqs == [short] and plan.num_prefill_tokens == 16 and plan.num_decode_tokens == 1
    late = add(scheduler, "late", 10, 2.0)
    plan, batch = step(scheduler)
    assert batch.query_lens == [1, 16, 3]  # the late prompt gets what is left of the budget
    assert batch.num_tokens == 20 and late.num_computed_tokens == 3 and long.num_computed_tokens == 32


def test_running_cap_keeps_requests_waiting() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(scheduler, str(i), 5, float(i))
    step(scheduler)
    assert [s.request_id for s in scheduler.running] == ["0", "1"]
    assert [s.request_id for s in scheduler.waiting] == ["2"]


def test_out_of_blocks_preempts_the_latest_arrival_which_recomputes_later() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    first = add(scheduler, "first", 8, 0.0)  # 2 blocks
    second = add(scheduler, "second", 8, 1.0)  # 2 blocks: the pool is full
    step(scheduler)
    assert scheduler.kv.num_free_blocks == 0
    plan, batch = step(scheduler)  # both decode position 8: a fifth block is needed
    assert plan.preempted == [second] and scheduler.num_preemptions == 1
    assert plan.sample_seqs == [first] and second.status is SequenceStatus.WAITING
    assert second.num_computed_tokens == 0 and not scheduler.kv.table("second")
    scheduler.finish(first, "stop")
    plan, batch = step(scheduler)  # the victim comes back: prompt and its output token are recomputed
    assert batch.query_lens == [9] and plan.sample_seqs == [second]
    assert second.output_token_ids == [7, 7]


def test_prompt_that_can_never_fit_is_rejected_not_looped_on() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    too_long = add(scheduler, "too-long", 17, 0.0)
    fine = add(scheduler, "fine", 5, 1.0)
    plan, batch = step(scheduler)
    assert plan.rejected == [too_long] and too_long.finish_reason == "error" and "16" in too_long.error
    assert plan.sample_seqs == [fine] and not scheduler.waiting


def test_finish_frees_blocks_of_waiting_and_running_sequences() -> None:
    scheduler = make_scheduler(num_blocks=8, block_size=4, prefill_chunk_size=4)
    running = add(scheduler, "running", 12, 0.0)
    waiting = add(scheduler, "waiting", 4, 1.0)
    scheduler.max_num_seqs = 1
    step(scheduler)
    assert scheduler.kv.num_free_blocks == 7
    scheduler.finish(running, "abort")
    scheduler.finish(waiting, "abort")
    assert scheduler.kv.num_free_blocks == 8 and not (scheduler.waiting or scheduler.running)


def test_higher_priority_is_admitted_first_and_preempted_last() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=1)
    low = add(scheduler, "low", 4, 0.0)
    high = Sequence("high", [1, 2, 3, 4], SamplingParams(), priority=5, arrival_time=1.0)
    scheduler.add(high)
    assert step(scheduler)[0].sample_seqs == [high]
    scheduler.max_num_seqs = 2
    step(scheduler)  # low is admitted next to high
    assert scheduler.policy.pick_victim(scheduler.running) is low


def test_engine_config_refuses_bad_limits_with_a_clear_message() -> None:
    for kwargs, message in [
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"max_batched_tokens": 32}, "max_num_seqs must not exceed"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy("lifo")


def test_prefill_beside_decodes_fits_their_tightest_time_per_token_target() -> None:
    costs = StepCosts(overhead=0.010, per_prefill_token=0.001, per_decode=0.002, reliable=True)
    scheduler = make_scheduler(
        num_blocks=256,
        prefill_chunk_size=256,
        max_batched_tokens=512,
        prefill_budget=lambda d, s: costs.prefill_tokens_within(s, d),
    )
    fast, slow = add(scheduler, "fast", 3, 0.0), add(scheduler, "slow", 3, 0.1)
    fast.tpot_target_s, slow.tpot_target_s = 0.05, 0.2
    step(scheduler)  # both prompts in one step: no decodes yet, so no limit
    add(scheduler, "long", 900, 1.0)
    plan, batch = step(scheduler)
    # (0.8 * 0.05 - 0.010 - 2 * 0.002) / 0.001: the step aims at TPOT_HEADROOM of the tightest target
    assert plan.num_decode_tokens == 2 and plan.num_prefill_tokens == 26
    assert costs.step_seconds(plan.num_prefill_tokens, plan.num_decode_tokens) <= TPOT_HEADROOM * 0.05
    assert scheduler.step_token_limit() == 3 + 24  # what a TTFT estimate assumes: all three running decode
    fast.tpot_target_s = 0.001  # a target no prefill fits: prompts still progress a little
    assert step(scheduler)[0].num_prefill_tokens == MIN_PREFILL_TOKENS
    fast.tpot_target_s = slow.tpot_target_s = None  # no targets: the whole budget
    assert step(scheduler)[0].num_prefill_tokens == 256


def test_a_request_past_its_start_deadline_is_refused_unstarted_and_a_started_one_is_kept() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running = add(scheduler, "running", 8, 0.0)
    step(scheduler)
    running.start_deadline = time.monotonic() - 1.0  # passed, but it has started: it keeps running
    late = add(scheduler, "late", 8, 1.0)
    late.start_deadline = time.monotonic() - 1.0
    patient = add(scheduler, "patient", 8, 2.0)
    patient.start_deadline = time.monotonic() + 3600.0
    plan, batch = step(scheduler)
    assert plan.rejected == [late]
    assert late.finish_reason == "deadline" and "deadline" in late.error
    assert late.first_scheduled_time is None and not scheduler.kv.table("late")
    assert running.status is SequenceStatus.RUNNING and patient in scheduler.waiting
    assert late not in scheduler.waiting


def test_a_full_engine_asks_its_policy_only_about_the_prompts_it_can_still_run() -> None:
    scheduler = make_scheduler(max_num_seqs=2, prefill_chunk_size=8, max_batched_tokens=64)
    picks: list[str] = []
    choose = scheduler.policy.pick_next

    def counted(waiting, planned=None):
        seq = choose(waiting, planned)
        picks.append(seq.request_id)
        return seq

    scheduler.policy.pick_next = counted
    long_prompt = add(scheduler, "long", 20, 0.0)
    add(scheduler, "short", 4, 1.0)
    for i in range(50):  # a queue that cannot be admitted while both places are taken
        add(scheduler, f"queued-{i}", 4, 2.0 + i)
    step(scheduler)
    assert picks == ["long", "short"]  # both admitted; the 50 waiting are not offered one by one
    picks.clear()
    plan, _ = step(scheduler)
    assert picks == ["long"] and long_prompt.num_computed_tokens == 16  # its second chunk beside a decode
    assert len(scheduler.waiting) == 50 and plan.num_decode_tokens == 1
