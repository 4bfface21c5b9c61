"""The weighted fair-share policy (VTC in cost units): order, lift, victim, recompute not charged, memory."""

from __future__ import annotations

import itertools

import pytest

from engine.config import EngineConfig
from engine.cost import CostWeights
from engine.kv_cache import KVCacheManager
from engine.policies import FairSharePolicy, make_policy
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.types import SamplingParams
from tests.engine.engine_helpers import run_plan

_ids = itertools.count()


def request(tenant: str, arrival: float, weight: float = 1.0, priority: int = 0, prompt: int = 4) -> Sequence:
    first = next(_ids) * 1000
    return Sequence(
        f"{tenant}-{arrival}",
        list(range(first + 1, first + prompt + 1)),
        SamplingParams(),
        tenant_id=tenant,
        priority=priority,
        arrival_time=arrival,
        weight=weight,
    )


def test_the_tenant_with_the_smallest_weighted_counter_goes_next() -> None:
    policy = FairSharePolicy(CostWeights(prefill=1, cached=0.1, decode=2))
    a1, a2, b1 = request("a", 0.0), request("a", 1.0), request("b", 2.0, weight=2.0)
    for seq in (a1, a2, b1):
        policy.on_arrival(seq)
    assert policy.pick_next([a1, a2, b1]) is a1  # equal counters: the oldest request goes first
    late, early = request("z", 5.0), request("y", 4.0)
    assert FairSharePolicy().pick_next([late, early]) is early  # not the tenant's name
    policy.on_tokens(a1, 10, 5, cached_tokens=20)  # a: (10 + 2 + 10) / 1 = 22
    policy.on_tokens(b1, 30, 0)  # b: 30 / 2 = 15
    assert policy.counters == {"a": pytest.approx(22.0), "b": pytest.approx(15.0)}
    assert policy.pick_next([a2, b1]) is b1
    urgent = request("a", 3.0, priority=5)
    policy.on_arrival(urgent)
    policy.on_tokens(b1, 20, 0)  # b: 25
    assert policy.pick_next([a2, urgent, b1]) is urgent  # priority orders requests within a tenant


def test_a_tenant_back_from_idle_is_lifted_and_banks_no_credit() -> None:
    policy = FairSharePolicy()
    busy, quiet = request("busy", 0.0), request("quiet", 0.0)
    policy.on_arrival(busy)
    policy.on_arrival(quiet)
    policy.on_tokens(quiet, 5, 0)
    policy.on_finish(quiet)  # quiet goes idle at counter 5
    policy.on_tokens(busy, 500, 0)
    returning = request("quiet", 10.0)
    policy.on_arrival(returning)
    assert policy.counters["quiet"] == 500  # lifted to the smallest active counter, not left at 5
    policy.on_finish(busy)
    policy.on_finish(returning)
    alone = request("new", 20.0)
    policy.on_arrival(alone)
    assert policy.counters["new"] == 500  # nobody active: the last served counter


def test_the_victim_is_the_latest_request_of_the_tenant_furthest_over_its_share() -> None:
    policy = FairSharePolicy()
    heavy_old, heavy_new, light = request("heavy", 0.0), request("heavy", 5.0), request("light", 9.0)
    for seq in (heavy_old, heavy_new, light):
        policy.on_arrival(seq)
    policy.on_tokens(heavy_old, 100, 0)
    assert policy.pick_victim([heavy_old, heavy_new, light]) is heavy_new
    assert make_policy("fcfs").pick_victim([heavy_old, heavy_new, light]) is light


def test_tokens_ahead_count_only_tenants_not_above_the_counter() -> None:
    policy = FairSharePolicy()
    heavy, light = request("heavy", 0.0), request("light", 1.0)
    policy.on_arrival(heavy)
    policy.on_arrival(light)
    policy.on_tokens(heavy, 1000, 0)
    queued = {"heavy": 4000, "light": 300}
    assert policy.tokens_ahead(queued, "light") == 300  # the heavy tenant's queue is served after
    assert policy.tokens_ahead(queued, "heavy") == 4300
    # lifted to the smallest active counter (light's): light is served while its counter catches up
    assert policy.tokens_ahead(queued, "newcomer", prompt_tokens=100) == 100
    assert policy.tokens_ahead(queued, "newcomer", prompt_tokens=100, weight=2.0) == 50


def test_tokens_ahead_count_what_tenants_below_the_counter_will_send_meanwhile() -> None:
    now = [0.0]
    policy = FairSharePolicy(clock=lambda: now[0])
    early = request("early", 0.0)
    policy.on_arrival(early)
    for i in range(300):  # late sends 300 prompts of 50 tokens over 30 s: 500 tokens/s
        now[0] = i / 10
        policy.on_arrival(request("late", now[0], prompt=50))
        if i == 0:
            policy.on_tokens(early, 1000, 0)  # early's counter: 1000, late's: 0
    queued = {"late": 200}
    assert policy.tokens_ahead(queued, "early") == 200  # what is queued now
    within_1s = policy.tokens_ahead(queued, "early", horizon_s=1.0)
    assert 200 + 450 < within_1s < 200 + 550  # and what late sends within a second, below early's counter
    assert policy.tokens_ahead(queued, "early", horizon_s=60.0) == 1000  # never past early's level
    assert policy.tokens_ahead(queued, "late", horizon_s=60.0) == 200  # early is above late: not ahead
    now[0] += 100  # late stopped sending long ago: its rate has decayed away
    assert policy.tokens_ahead(queued, "early", horizon_s=1.0) == 200


def test_recomputed_prefill_after_preemption_is_not_charged() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, prefix_caching=False)
    policy = FairSharePolicy(CostWeights(prefill=1, cached=0.1, decode=2))
    limits = EngineConfig(max_batched_tokens=16, max_num_seqs=16, prefill_chunk_size=16)
    scheduler = Scheduler(kv, policy, limits, max_model_len=16)
    first, second = request("a", 0.0, prompt=6), request("b", 1.0, prompt=6)
    for seq in (first, second):
        scheduler.add(seq)
    token = itertools.count(50_000)
    for _ in range(12):  # both grow until blocks run out and one is preempted and recomputed
        plan, _ = run_plan(scheduler)
        for seq in plan.sample_seqs:
            scheduler.append_token(seq, next(token))
    assert scheduler.num_preemptions > 0
    for seq in (first, second):
        billed = 1 * seq.num_prompt_tokens + 2 * seq.num_output_tokens
        assert policy.counters[seq.tenant_id] == billed


def test_prompt_tokens_are_charged_once_the_step_ran_not_when_it_is_planned() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_caching=False)
    policy = FairSharePolicy(CostWeights(prefill=1, cached=0.1, decode=2))
    scheduler = Scheduler(kv, policy, EngineConfig(max_batched_tokens=4, max_num_seqs=4), max_model_len=32)
    seq = request("a", 0.0, prompt=6)
    scheduler.add(seq)
    plan = scheduler.schedule()  # the first chunk: 4 of the 6 prompt tokens
    assert plan.scheduled == [(seq, 4)] and policy.counters[seq.tenant_id] == 0
    scheduler.complete(plan)
    assert policy.counters[seq.tenant_id] == 4 and seq.num_computed_tokens == 4


def test_idle_tenants_are_forgotten_beyond_the_cap() -> None:
    policy = FairSharePolicy(max_idle_tenants=3)
    for i in range(10):
        seq = request(f"t{i}", float(i))
        policy.on_arrival(seq)
        policy.on_tokens(seq, 10, 0)
        policy.on_finish(seq)
    assert set(policy.counters) == {"t7", "t8", "t9"}
    assert make_policy("fair").name == "fair"


def test_a_light_tenants_prompt_is_prefilled_before_a_heavy_tenants_admitted_long_prompts() -> None:
    kv = KVCacheManager(num_blocks=256, block_size=4, prefix_caching=False)
    limits = EngineConfig(max_batched_tokens=64, prefill_chunk_size=32)
    scheduler = Scheduler(kv, FairSharePolicy(), limits, max_model_len=1024)
    heavy = [request("heavy", float(i), prompt=200) for i in range(3)]
    for seq in heavy:
        scheduler.add(seq)
    first, _ = run_plan(scheduler)  # the heavy prompts are admitted and their prefill begins
    assert first.num_prefill_tokens == 64
    light = request("light", 10.0, prompt=24)
    scheduler.add(light)
    plan, batch = run_plan(scheduler)
    served = dict(zip(batch.query_lens, batch.context_lens, strict=True))
    assert light.num_computed_tokens == 24 and 24 in served  # all of the light prompt, in this step
    assert plan.num_prefill_tokens == 64  # and the heavy prompts take the rest of the budget
    fcfs = Scheduler(
        KVCacheManager(num_blocks=256, block_size=4, prefix_caching=False),
        make_policy("fcfs"),
        limits,
        max_model_len=1024,
    )
    for seq in [request("heavy", float(i), prompt=200) for i in range(3)]:
        fcfs.add(seq)
    run_plan(fcfs)
    late = request("light", 10.0, prompt=24)
    fcfs.add(late)
    run_plan(fcfs)
    assert late.num_computed_tokens == 0  # first come, first served: it waits behind the heavy prompts


def test_share_ratio_is_recent_service_over_the_weighted_share_of_the_tenants_sharing() -> None:
    now = [0.0]
    policy = FairSharePolicy(CostWeights(prefill=1, cached=0.1, decode=2), clock=lambda: now[0])
    assert policy.share_ratio("anyone") == 0.0  # nothing served yet: nobody is over its share
    heavy, light = request("heavy", 0.0), request("light", 0.0, weight=2.0)
    policy.on_arrival(heavy)
    policy.on_tokens(heavy, 900, 0)
    assert policy.share_ratio("heavy") == pytest.approx(1.0)  # alone: all the service is its share
    assert policy.share_ratio("heavy", 1.0) == pytest.approx(1.0)
    policy.on_arrival(light)
    policy.on_tokens(light, 100, 0)
    # heavy: 90 % of the service against a share of 1/3 (light weighs 2)
    assert policy.share_ratio("heavy") == pytest.approx(0.9 * 3)
    assert policy.share_ratio("light", 2.0) == pytest.approx(0.1 * 1.5)
    assert policy.share_ratio("newcomer") == 0.0
    policy.on_finish(light)
    now[0] = 20.0  # one half-life later both have decayed alike; light still counts as sharing
    assert policy.share_ratio("heavy") == pytest.approx(2.7)
    now[0] = 100.0  # light sent nothing for longer than the window: heavy's share is all of it again
    assert policy.share_ratio("heavy") == pytest.approx(0.9)  # (of the recent service, as decayed)
