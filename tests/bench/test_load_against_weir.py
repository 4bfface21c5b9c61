"""The serve benchmark's load generator against a real ``weir serve``: streams, usage and refusals."""

from __future__ import annotations

from bench.http_load import run_load, served_model
from bench.latency import summarize
from bench.model import load_tokenizer
from bench.serve import build_load
from bench.workload import WorkloadSpec
from tests.api.server import wait_until


async def test_load_streams_counts_tokens_and_refusals(api_server, make_tenant, tiny_model_dir):
    tenant, key = make_tenant()
    _, broke_key = make_tenant(monthly_budget=1)  # every request's reservation exceeds it: 429
    spec = WorkloadSpec(num_requests=6, prompt_len=(8, 24), output_len=(3, 8), seed=5)
    load = build_load(load_tokenizer(tiny_model_dir), spec, rate=20.0, keys=[key, broke_key])
    model = await served_model(api_server.v1, key)

    records = await run_load(api_server.v1, model, load)

    served = [r for r, req in zip(records, load, strict=True) if req.api_key == key]
    refused = [r for r, req in zip(records, load, strict=True) if req.api_key == broke_key]
    assert [r.status for r in refused] == [429] * len(refused)
    for record, request in zip(served, load[::2], strict=True):
        assert record.ok, record.error
        assert 1 <= record.output_tokens <= request.max_tokens
        assert record.prompt_tokens and record.chunk_times
        assert record.ttft <= record.e2e
    summary = summarize(records, slo_ttft_s=60, slo_tpot_s=60)
    assert summary["completed"] == len(served)
    assert summary["refused"] == {"429": len(refused)}
    assert summary["goodput_rps"] == summary["request_throughput_rps"]  # everything served met a loose SLO

    def ledger_complete() -> list[dict] | None:
        rows = api_server.usage_rows(tenant)
        return rows if len(rows) == len(served) else None

    rows = wait_until(ledger_complete, what="the served requests' usage events")
    assert sum(row["output_tokens"] for row in rows) == summary["output_tokens"]
