"""`weir bench overload`: the figures of one tenant's requests, and a short run of both policies' servers."""

from __future__ import annotations

import json

from api.cli import main
from bench.latency import RequestRecord
from bench.overload_load import (
    CAPACITY_PRECISION,
    CAPACITY_STEP,
    CAPACITY_TRIALS,
    LOADS,
    TENANTS,
    Bracket,
    Slo,
    refusal_latency_p99_ms,
    tenant_figures,
)
from tests.fixtures.database import copy_of_template


def _served(ttft: float, tpot: float, tokens: int = 5) -> RequestRecord:
    first = 10.0 + ttft
    chunks = [first + i * tpot for i in range(tokens)]
    return RequestRecord(sent=10.0, status=200, chunk_times=chunks, done=chunks[-1], output_tokens=tokens)


def test_the_capacity_search_brackets_the_rate_that_meets_the_target():
    capacity = 7.0  # a server that meets the target at any rate up to this one

    def search(start: float) -> tuple[Bracket, list[float]]:
        bracket, tried, rate = Bracket(), [], start
        while rate is not None:
            tried.append(rate)
            rate = bracket.next_rate(rate, rate <= capacity)
        return bracket, tried

    for start in (3.0, 7.0, 15.0):  # within a step or two of the burst's rate
        bracket, tried = search(start)
        assert bracket.met <= capacity < bracket.missed <= bracket.met * CAPACITY_PRECISION
        assert len(tried) <= CAPACITY_TRIALS
    _, upward = search(1.0)
    assert upward[:3] == [1.0, CAPACITY_STEP, CAPACITY_STEP**2]  # up by the step until one misses


def test_a_tenant_is_judged_on_its_admitted_requests_and_refusals_are_counted_apart():
    refused = RequestRecord(sent=3.0, status=503, done=3.02, refusal="server_overloaded")
    records = [_served(0.5, 0.1), _served(3.0, 0.1), _served(0.5, 0.9), refused]
    figures = tenant_figures(records, Slo(ttft_s=2.0, tpot_s=0.5), seconds=10.0, light=True)
    assert figures["slo_attainment"] == round(1 / 3, 4)  # one of the three admitted met both targets
    assert figures["refused_share"] == 0.25
    assert figures["goodput_rps"] == 0.1
    assert figures["refusals"] == {"503 server_overloaded": 1}
    assert figures["ttft_p99_ms"] > 2900 and figures["light"] is True
    assert refusal_latency_p99_ms(records) == 20.0


def test_overload_runs_both_policies_on_servers_of_its_own(
    tiny_model_dir, pg_server_url, migrated_template, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "overload.json"
    options = ["--model", str(tiny_model_dir), "--dtype", "float32", "--seconds", "1", "--out", str(out)]
    with copy_of_template(pg_server_url, migrated_template, prefix="weir_overload") as url:
        monkeypatch.setenv("DATABASE_URL", url)
        assert main(["bench", "overload", *options]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())

    assert result["capacity_rps"] > 0 and result["ttft_target_ms"] == 2000
    assert set(result["loads"]) == set(LOADS)
    for load, by_policy in result["loads"].items():
        assert set(by_policy) == {"fcfs", "fair"}
        for o in by_policy.values():
            assert "refusal_latency_p99_ms" in o and set(o["tenants"]) == set(TENANTS)
            for tenant, t in o["tenants"].items():
                assert {"light", "slo_attainment", "refused_share", "ttft_p99_ms", "goodput_rps"} <= set(t)
                assert t["light"] is (load == "noisy" and tenant != "a")
                # Admitted streams do not fail, but for a known limit: at 3x and 5x the tiny model's capacity
                # (hundreds of requests a second) the event loop of a 2-core server can fall more than the
                # 10 s header deadline behind, and closes a connection unanswered (the client's ReadError;
                # docs/benchmarks.md, "Overload"). At most one in a hundred, and never an error event.
                assert t["failed"] <= t["admitted"] / 100, t["failures"]
                assert all(error.startswith("ReadError") for error in t["failures"]), t["failures"]
                assert t["requests"] == t["admitted"] + sum(t["refusals"].values())
                assert all(not key.endswith(" -") for key in t["refusals"])  # every refusal said why
    noisy = result["loads"]["noisy"]["fair"]["tenants"]
    assert noisy["a"]["requests"] > noisy["b"]["requests"]
    for column in ("SLO met % (admitted)", "refused %", "refusal latency p99 ms"):
        assert column in printed
