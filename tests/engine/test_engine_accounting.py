"""KV block accounting through the engine: random arrivals, lengths and aborts; aborts free blocks at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.client import AsyncEngine
from engine.core import RATIO_TAIL_MIN, EngineCore, generate_offline
from engine.types import SamplingParams
from tests.engine.engine_helpers import (
    assert_block_references_match,
    engine_config,
    make_core,
    random_prompts,
)

_ids = itertools.count()


@pytest.fixture(scope="module")
def small_core(tiny_model_dir: Path) -> EngineCore:
    """12 blocks of 4 tokens, 8-token chunks, 20 tokens a step, 4 running: preemption is common."""
    limits = {"prefill_chunk_size": 8, "max_batched_tokens": 20, "max_num_seqs": 4}
    return make_core(tiny_model_dir, num_kv_blocks=12, block_size=4, **limits)


request_strategy = st.tuples(
    st.integers(1, 52),  # prompt length; above 48 tokens it can never fit the pool
    st.integers(1, 6),  # max_tokens
    st.integers(0, 5),  # step at which it arrives
    st.none() | st.integers(0, 10),  # step at which it is aborted, if ever
    st.booleans(),  # whether the prompt starts with the prefix other requests share
)
SHARED_PREFIX = random_prompts((20,), seed=99)[0]


@settings(max_examples=15, deadline=None)
@given(requests=st.lists(request_strategy, min_size=1, max_size=7))
def test_blocks_are_never_owned_twice_and_all_return(small_core: EngineCore, requests) -> None:
    core = small_core
    ids = [f"p{next(_ids)}" for _ in requests]
    prompts = random_prompts(tuple(r[0] for r in requests), seed=len(requests))
    prompts = [
        (SHARED_PREFIX + prompt)[: len(prompt)] if request[4] else prompt
        for prompt, request in zip(prompts, requests, strict=True)
    ]
    finished: dict[str, str] = {}
    for step in range(200):
        for request_id, prompt, (_, limit, arrival, abort_at, _) in zip(ids, prompts, requests, strict=True):
            if arrival == step:
                core.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=limit))
            if abort_at == step and arrival <= step and core.abort(request_id):
                assert not core.kv.table(request_id)
        if step > 10 and not core.has_unfinished():
            break
        for out in core.step():
            assert out.request_id not in finished, "a request ended twice"
            if out.finished:
                finished[out.request_id] = out.finish_reason
        assert_block_references_match(core.kv, ids)
        running = {seq.request_id for seq in core.scheduler.running}
        assert {request_id for request_id in ids if core.kv.table(request_id)} <= running
    assert not core.has_unfinished(), "the engine did not drain"
    assert core.kv.num_free_blocks == core.kv.num_blocks
    assert set(finished) == set(ids)
    for (prompt_len, _, arrival, abort_at, _), request_id in zip(requests, ids, strict=True):
        if prompt_len > core.max_model_len:
            # refused when the scheduler first picks it, unless an abort came before that
            aborted = abort_at is not None and abort_at >= arrival
            expected = {"error", "abort"} if aborted else {"error"}
            assert finished[request_id] in expected
        else:
            assert finished[request_id] in ("length", "stop", "abort")


def test_aborted_request_frees_its_blocks_before_the_next_step(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, block_size=4)
    prompts = random_prompts((30, 10), seed=3)
    core.add_request("keep", prompts[0], SamplingParams(temperature=0, max_tokens=50))
    core.add_request("drop", prompts[1], SamplingParams(temperature=0, max_tokens=50))
    core.step()
    core.step()
    with pytest.raises(ValueError, match="already in the engine"):
        core.add_request("keep", prompts[1], SamplingParams())
    held = len(core.kv.table("drop"))
    free_before = core.kv.num_free_blocks
    assert core.abort("drop") and not core.abort("drop")
    assert core.kv.num_free_blocks == free_before + held and not core.kv.table("drop")
    outputs = {out.request_id: out for out in core.step()}
    assert outputs["drop"].finished and outputs["drop"].finish_reason == "abort"
    assert outputs["drop"].output_tokens == 2 and not outputs["keep"].finished


def test_only_the_prompt_that_ran_is_reported(tiny_model_dir: Path) -> None:
    """Refused for its size, aborted while queued, aborted mid-prefill, or served: a request's prompt counts
    are the tokens the engine computed (what it is billed for), never the whole prompt unless it all ran."""
    limits = {"prefill_chunk_size": 8, "max_batched_tokens": 8, "max_num_seqs": 1}
    core = make_core(tiny_model_dir, num_kv_blocks=16, block_size=4, **limits)  # 64 tokens at most
    huge, long, queued = random_prompts((core.max_model_len + 16, 24, 10), seed=11)
    params = SamplingParams(temperature=0, max_tokens=4)

    core.add_request("huge", huge, params)
    [refused] = core.step()
    assert (refused.finish_reason, refused.prompt_tokens, refused.cached_tokens) == ("error", 0, 0)

    core.add_request("long", long, params)
    assert core.step() == []  # its first chunk of 8 tokens
    core.add_request("queued", queued, params)
    assert core.step() == []  # its second chunk; "queued" waits, one sequence runs at most
    assert core.abort("queued") and core.abort("long")
    ended = {out.request_id: out for out in core.step()}
    assert (ended["queued"].prompt_tokens, ended["queued"].cached_tokens) == (0, 0)
    assert ended["queued"].queue_time is None
    assert (ended["long"].prompt_tokens, ended["long"].cached_tokens) == (16, 0)

    [served] = generate_offline(core, [(queued, params)])
    assert served.finished and served.prompt_tokens == len(queued)


async def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_cancelled_consumer_aborts_and_slow_consumer_gets_merged_deltas(tiny_model_dir: Path) -> None:
    prompts = random_prompts((20, 12), seed=5)
    async with AsyncEngine(engine_config(tiny_model_dir, block_size=4)) as engine:
        total = engine.stats().kv_blocks_total
        started = asyncio.Event()

        async def consume_forever() -> None:
            params = SamplingParams(temperature=0, max_tokens=2000)
            async for _ in engine.generate("gone", prompts[0], params):
                started.set()

        task = asyncio.create_task(consume_forever())
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its cleanup has asked for the abort
        steps_at_abort = engine.stats().steps
        await wait_for(lambda: engine.stats().kv_blocks_free == total)
        assert engine.stats().steps <= steps_at_abort + 1  # at most the step that was in flight

        stream = engine.generate("slow", prompts[1], SamplingParams(temperature=0, max_tokens=64))
        first = await anext(stream)  # then the consumer reads nothing until the request has ended
        await wait_for(lambda: engine.stats().running == engine.stats().waiting == 0)
        # the stats may show the end a moment before the engine thread delivers the last delta: read on
        rest = [await anext(stream)]
        while not rest[-1].finished:
            rest.append(await anext(stream))
        assert not first.finished and len(rest) <= 2 and rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == rest[-1].output_tokens == 64
        assert len(rest[0].token_ids) == len(rest[0].token_times) > 1  # several steps' deltas merged into one
        assert engine.stats().kv_blocks_free == total
        with pytest.raises(ValueError, match="no tokens"):
            await anext(engine.generate("empty", [], SamplingParams()))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await anext(engine.generate("bad", [1, 10**9], SamplingParams()))


def test_ttft_estimate_grows_with_the_prefill_queued_ahead(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    assert core.kv.num_free_blocks == core.kv.num_blocks  # the start-up calibration returned its blocks
    empty = core.estimate_ttft(100)
    assert empty.reliable and empty.queued_tokens == 0  # calibrated at start-up
    for i, prompt in enumerate(random_prompts((300, 200), seed=8)):
        core.add_request(f"q{i}", prompt, SamplingParams(temperature=0, max_tokens=2))
    queued = core.estimate_ttft(100)  # its own tenant's queue is all ahead of it
    assert queued.queued_tokens == 500
    assert 0 < empty.seconds < queued.seconds
    # another tenant's request, under the fair policy: only what the queued tenant is served while the
    # newcomer's counter climbs through its own prompt
    assert core.estimate_ttft(100, "someone").queued_tokens == 100
    while core.has_unfinished():
        core.step()
    assert core.estimate_ttft(100).queued_tokens == 0
    assert core.estimate_ttft(100).seconds < core.estimate_ttft(600).seconds
    stats = core.stats()
    assert stats.ttft_estimate_ratio_p50 is not None and stats.ttft_estimate_ratio_p50 > 0


def test_a_tenant_with_enough_finished_requests_has_its_own_estimate_error(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    prompts = random_prompts([40] * RATIO_TAIL_MIN, seed=9)

    def run(batch: list[list[int]], first: int) -> None:
        for i, prompt in enumerate(batch, first):
            core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=2), tenant_id="busy")
        while core.has_unfinished():
            core.step()

    run(prompts[:-1], 0)  # one too few for a tail: the median is known, no 95th percentile yet
    assert core.estimate_ttft(40, "busy").tenant_ratio_tail is None
    assert core.stats().ttft_estimate_ratio_p95 is None and core.stats().ttft_estimate_ratio_p50 is not None
    run(prompts[-1:], len(prompts) - 1)
    own = core.estimate_ttft(40, "busy").tenant_ratio_tail
    assert own is not None and own > 0
    assert own == core.stats().ttft_estimate_ratio_p95  # the only tenant so far: the engine's figure too
    assert core.estimate_ttft(40, "quiet").tenant_ratio_tail is None  # none finished: the engine's is used
