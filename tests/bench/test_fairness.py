"""`weir bench fairness`: the service figures, and a short run of both policies on the tiny model."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from api.cli import main
from bench.fairness_workloads import TenantLoad
from bench.service_meter import StepRecord, contended_service, max_weighted_gap


def _records(*steps: tuple[dict[str, float], str]) -> list[StepRecord]:
    """Records from (service so far, backlogged tenants as letters) per step, after a zero start."""
    return [StepRecord({}, frozenset())] + [StepRecord(served, frozenset(b)) for served, b in steps]


def test_gap_is_the_widest_weighted_difference_within_a_span_both_are_backlogged():
    records = _records(
        ({"a": 10, "b": 0}, "ab"),  # difference 10
        ({"a": 10, "b": 30}, "ab"),  # -20: range 30 within this span
        ({"a": 100, "b": 30}, "a"),  # b idle: the span ends, a's 90 alone is not a gap
        ({"a": 100, "b": 40}, "ab"),  # new span from 70: now 60
        ({"a": 110, "b": 40}, "ab"),  # 70
    )
    assert max_weighted_gap(records, {"a": 1.0, "b": 1.0}) == 30
    # weighted: b's service counts half, so the first span runs 10 -> 10 -> -5
    assert max_weighted_gap(records, {"a": 1.0, "b": 2.0}) == 15


def test_shares_count_only_steps_in_which_every_tenant_is_backlogged():
    records = _records(({"a": 50}, "a"), ({"a": 60, "b": 30}, "ab"), ({"a": 80, "b": 50}, "ab"))
    assert contended_service(records, frozenset("ab")) == {"a": 30, "b": 50}


def test_on_off_tenant_sends_its_burst_once_and_a_backlogged_one_tops_up():
    steady, burst = TenantLoad("a", depth=4), TenantLoad("b", start=0.5, burst=3)
    assert steady.wants(in_engine=1, sent=9, progress=0.1) == 3
    assert burst.wants(in_engine=0, sent=0, progress=0.4) == 0
    assert burst.wants(in_engine=0, sent=0, progress=0.5) == 3
    assert burst.wants(in_engine=1, sent=3, progress=0.9) == 0


@pytest.fixture(scope="module")
def fairness_run(tiny_model_dir, tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("fairness") / "fairness.json"
    # a fixed number of steps (and no time limit that could end a run first): the run is deterministic
    options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--steps", "200"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["bench", "fairness", *options, "--out", str(out)])
    assert status == 0
    return json.loads(out.read_text()), printed.getvalue()


def test_the_json_has_every_workload_with_both_policies(fairness_run):
    result, printed = fairness_run
    assert set(result["workloads"]) == {"rate", "shapes", "weights", "onoff"}
    for runs in result["workloads"].values():
        assert set(runs) == {"fcfs", "fair"}
        for r in runs.values():
            assert {"throughput_tokens_per_s", "max_weighted_gap", "bound", "tenants"} <= set(r)
            assert r["throughput_tokens_per_s"] > 0 and r["steps"] == 200
            for tenant in r["tenants"].values():
                assert {"weight", "share", "weight_share"} <= set(tenant)
            assert sum(t["share"] for t in r["tenants"].values()) == pytest.approx(1, abs=1e-3)
        assert runs["fair"]["max_weighted_gap"] <= runs["fair"]["bound"]
    for column in ("share/weight share", "fair/fcfs", "fair within bound"):
        assert column in printed


def test_fair_gives_weights_1_2_3_their_shares_and_fcfs_does_not(fairness_run):
    weights = fairness_run[0]["workloads"]["weights"]
    for tenant in weights["fair"]["tenants"].values():
        assert tenant["share"] == pytest.approx(tenant["weight_share"], rel=0.1)
    fcfs = weights["fcfs"]["tenants"]
    assert fcfs["w1"]["share"] > 1.5 * fcfs["w1"]["weight_share"]


def test_fair_splits_evenly_where_fcfs_follows_the_sending_rate(fairness_run):
    rate = fairness_run[0]["workloads"]["rate"]
    assert rate["fair"]["tenants"]["b"]["share"] == pytest.approx(0.5, abs=0.05)
    assert rate["fcfs"]["tenants"]["a"]["share"] > 0.6


def test_a_returning_tenant_is_lifted_not_credited_for_its_idle_time(fairness_run):
    onoff = fairness_run[0]["workloads"]["onoff"]["fair"]["tenants"]
    assert 0.35 <= onoff["b"]["share"] <= 0.6
