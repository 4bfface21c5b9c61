"""What a request is billed with, without a server: the tracker folds the engine's deltas with
``RequestOutput.merge``, and the output allowance holds them to what was reserved."""

from __future__ import annotations

from api.metering import Job, Tracker
from api.openai_format import ResponseShape
from api.output_allowance import EXTEND_AHEAD, OutputAllowance
from engine.cost import DEFAULT_WEIGHTS
from engine.types import RequestOutput, SamplingParams
from tenants.quotas import Reservation


def _job(prompt_len: int = 3) -> Job:
    return Job(
        request_id="r1",
        tenant_id=1,
        tenant_name="t",
        key_id=None,
        prompt_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=8),
        shape=ResponseShape(chat=False, model="m", include_usage=False, id="r1"),
        stream=False,
        reservation=Reservation(tenant_id=1, cost=10.0, id=1),
        output=OutputAllowance.fixed(8),
    )


def _delta(tokens: list[int], times: list[float], total: int, **fields) -> RequestOutput:
    return RequestOutput(
        "r1",
        text="x" * len(tokens),
        token_ids=tokens,
        token_times=times,
        prompt_tokens=3,
        output_tokens=total,
        arrival_time=1.0,
        queue_time=0.5,
        first_token_time=2.0,
        **fields,
    )


def test_the_tracker_merges_deltas_into_the_counts_text_and_times_billed() -> None:
    tracker = Tracker(_job())
    tracker.update(_delta([7], [2.0], 1, cached_tokens=2))
    tracker.update(_delta([8, 9], [2.5, 3.0], 3, cached_tokens=2, finished=True, finish_reason="stop"))
    assert (tracker.prompt_tokens, tracker.total.cached_tokens, tracker.total.output_tokens) == (3, 2, 3)
    assert tracker.total.text == "xxx" and tracker.outcome() == ("ok", "stop")
    timings = tracker.timings()
    assert (timings["queue_s"], timings["ttft_s"], timings["tpot_s"]) == (0.5, 1.0, 0.5)
    assert tracker.cost(DEFAULT_WEIGHTS) == DEFAULT_WEIGHTS.prefill + 2 * DEFAULT_WEIGHTS.cached + 6.0


def test_a_request_the_engine_refused_is_billed_no_prompt() -> None:
    tracker = Tracker(_job(prompt_len=5))
    tracker.update(RequestOutput("r1", finished=True, finish_reason="error", error="refused"))
    assert tracker.prompt_tokens == 0 and tracker.outcome() == ("error", "error")
    assert tracker.cost(DEFAULT_WEIGHTS) == 0.0
    assert "refused" in tracker.error().message


def test_an_allowance_grows_ahead_of_the_output_and_stops_asking_once_ended() -> None:
    allowance = OutputAllowance(reserved=40, ceiling=100, step=16)
    assert allowance.wanted(40 - EXTEND_AHEAD - 1) == 0
    assert allowance.wanted(40 - EXTEND_AHEAD) == 16
    allowance.grant(16, granted=True)
    assert allowance.reserved == 56
    done = RequestOutput("r1", token_ids=[1], finished=True, finish_reason="stop", output_tokens=30)
    assert allowance.bound(done, tokenizer=None, prompt_ids=[]) is done  # within the reservation: as is
    assert allowance.wanted(55) == 0 and allowance.bound(done, None, []) is None
    allowance = OutputAllowance(reserved=40, ceiling=100, step=16)
    allowance.grant(16, granted=False)
    assert allowance.refused and allowance.reserved == 40 and allowance.wanted(39) == 0
