"""Seeded workloads, the latency summary and the table writer of the benchmarks."""

from __future__ import annotations

import json

import pytest

from bench.latency import RequestRecord, percentile, summarize
from bench.report import format_table, write_json
from bench.workload import (
    ChatSpec,
    WorkloadSpec,
    derived_seed,
    make_chat_workload,
    make_workload,
    redraw_prompts,
)

IDS = list(range(100, 400))


def test_workload_is_seeded_and_within_its_ranges():
    spec = WorkloadSpec(num_requests=20, prompt_len=(5, 30), output_len=(2, 9), seed=7)
    first, again = make_workload(spec, IDS), make_workload(spec, IDS)
    assert first == again
    other = make_workload(WorkloadSpec(20, (5, 30), (2, 9), seed=8), IDS)
    assert other != first
    assert all(5 <= r.prompt_len <= 30 and 2 <= r.output_len <= 9 for r in first)
    assert {t for r in first for t in r.prompt_ids} <= set(IDS)


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(prompt_len=(10, 5)), dict(output_len=(0, 4))])
def test_bad_workload_spec_is_refused(bad):
    with pytest.raises(ValueError):
        WorkloadSpec(**bad)


def test_redrawn_prompts_keep_the_lengths_with_other_tokens():
    base = make_workload(WorkloadSpec(12, (5, 30), (2, 9), seed=3), IDS)
    first, second = (
        redraw_prompts(base, IDS, derived_seed(3, 0)),
        redraw_prompts(base, IDS, derived_seed(3, 1)),
    )
    assert first == redraw_prompts(base, IDS, derived_seed(3, 0))
    for a, b, r in zip(first, second, base, strict=True):
        assert (a.prompt_len, a.output_len) == (b.prompt_len, b.output_len) == (r.prompt_len, r.output_len)
    assert [r.prompt_ids for r in first] != [r.prompt_ids for r in second]
    assert derived_seed(3, 1) not in (derived_seed(3, 0), derived_seed(4, 1))


def test_chat_workload_shares_one_system_prompt_over_its_turns():
    spec = ChatSpec(WorkloadSpec(5, (4, 10), (2, 6), seed=2), system_len=40, turns=3)
    chats = make_chat_workload(spec, IDS, prompt_seed=11)
    assert chats == make_chat_workload(spec, IDS, prompt_seed=11)
    assert len(chats.system_ids) == 40 and set(chats.system_ids) <= set(IDS)
    assert [len(turns) for turns in chats.conversations] == [3] * 5
    assert all(
        4 <= t.prompt_len <= 10 and 2 <= t.output_len <= 6 for turns in chats.conversations for t in turns
    )
    other = make_chat_workload(spec, IDS, prompt_seed=12)
    assert other.system_ids != chats.system_ids
    shape = [[(t.prompt_len, t.output_len) for t in turns] for turns in chats.conversations]
    assert shape == [[(t.prompt_len, t.output_len) for t in turns] for turns in other.conversations]
    with pytest.raises(ValueError):
        ChatSpec(WorkloadSpec(), turns=0)


def _record(sent, status=200, ttft=None, gap=0.0, tokens=0):
    record = RequestRecord(sent=sent, status=status)
    if ttft is not None:
        record.chunk_times = [sent + ttft + i * gap for i in range(tokens)]
        record.output_tokens = tokens
        record.done = record.chunk_times[-1]
    return record


def test_summary_counts_goodput_refusals_and_percentiles():
    records = [
        _record(0.0, ttft=0.5, gap=0.1, tokens=11),  # meets both SLOs
        _record(1.0, ttft=3.0, gap=0.1, tokens=11),  # TTFT too slow
        _record(2.0, ttft=0.5, gap=0.3, tokens=11),  # TPOT too slow
        _record(3.0, status=429),
        _record(3.5, status=503),
    ]
    summary = summarize(records, slo_ttft_s=2.0, slo_tpot_s=0.2)
    duration = records[2].done - 0.0
    assert summary["completed"] == 3
    assert summary["refused"] == {"429": 1, "503": 1}
    assert summary["goodput_rps"] == pytest.approx(1 / duration, rel=1e-3)
    assert summary["slo_attainment"] == pytest.approx(1 / 5)
    assert summary["output_tokens_per_s"] == pytest.approx(33 / duration, rel=1e-3)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500)
    assert summary["tpot_ms"]["p99"] == pytest.approx(percentile([100, 100, 300], 99), rel=1e-6)


def test_summary_counts_cached_prompt_tokens_and_skipped_turns():
    served = [_record(0.0, ttft=0.5, gap=0.1, tokens=5), _record(1.0, ttft=0.5, gap=0.1, tokens=5)]
    for record, (prompt, cached) in zip(served, [(100, 0), (300, 240)], strict=True):
        record.prompt_tokens, record.cached_tokens = prompt, cached
    skipped = RequestRecord(sent=2.0, skipped=True)
    summary = summarize([*served, skipped], slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert summary["cached_pct"] == pytest.approx(60.0)
    assert summary["prompt_tokens"] == 400
    assert (summary["skipped"], summary["refused"], summary["refused_total"]) == (1, {}, 0)
    assert summary["slo_attainment"] == round(2 / 3, 4)
    silent = _record(0.0, ttft=0.5, gap=0.1, tokens=5)
    silent.prompt_tokens = 50  # a server that reports no cached tokens
    assert summarize([silent], 2.0, 0.2)["cached_pct"] is None


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile([], 50) is None


def test_table_aligns_columns_and_json_round_trips(tmp_path):
    table = format_table(["system", "tok/s"], [["weir", 123.456], ["transformers", 9.5], ["none", None]])
    lines = table.splitlines()
    assert [line.index("tok/s") + len("tok/s") for line in lines[:1]] == [len(lines[0])]
    assert {len(line) for line in lines} == {len(lines[0])}
    assert "123.5" in table and "9.50" in table and lines[-1].endswith("-")
    with pytest.raises(ValueError):
        format_table(["a", "b"], [["only one"]])
    path = tmp_path / "out" / "r.json"
    write_json(path, {"systems": {"weir": {"output_tokens_per_s": 1.5}}})
    assert json.loads(path.read_text())["systems"]["weir"]["output_tokens_per_s"] == 1.5
