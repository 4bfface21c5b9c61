"""Telemetry of a running ``weir serve``: OTLP/HTTP trace exports received by a small collector in the test,
``GET /metrics`` parsed with prometheus_client's parser, and JSON request log lines with their trace id."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from prometheus_client.parser import text_string_to_metric_families

from api.telemetry import HTTP_METRIC_ATTRIBUTES
from api.tracing import MAX_MODEL_CHARS
from bench.otlp_receiver import Receiver, Span, otlp_receiver
from tenants.admin import get_tenant
from tests.api.server import ApiServer, run_db, serving, wait_until
from tests.fixtures.database import copy_of_template

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
LONG = 1500  # output tokens the tiny model would produce if nobody stopped it
METRICS_BYTES_BOUND = 1_000_000  # what one scrape may weigh after the flood below


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path,
    pg_server_url: str,
    migrated_template: str,
    receiver: Receiver,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ApiServer]:
    """``weir serve`` exporting traces and metrics by OTLP to ``receiver``, logging JSON, with a public
    ``/metrics`` and the HTTP metrics under both the old and the stable semantic conventions."""
    env = {
        "OTEL_SEMCONV_STABILITY_OPT_IN": "http/dup",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_SERVICE_NAME": "weir-test",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
    }
    options = ["--kv-cache-memory", "8", "--log-format", "json", "--log-level", "info", "--metrics-public"]
    with (
        copy_of_template(pg_server_url, migrated_template, prefix="weir_otel") as url,
        serving(tiny_model_dir, url, tmp_path_factory.mktemp("otel-state"), *options, env=env) as server,
    ):
        yield server


def _tenant(server: ApiServer, **options) -> tuple[str, str]:
    """A fresh tenant's name (its metric label) and API key."""
    tenant_id, key = run_db(server.database_url, server.create_tenant, **options)
    return run_db(server.database_url, get_tenant, tenant_id).name, key


def _model(server: ApiServer) -> str:
    return httpx.get(f"{server.base_url}/readyz").json()["model"]


def _generation_span(receiver: Receiver, attribute: str, value: object) -> Span:
    """The generation span whose ``attribute`` is ``value``, once it was exported."""

    def find() -> Span | None:
        matches = [s for s in receiver.snapshot() if "gen_ai.operation.name" in s.attributes]
        return next((s for s in matches if s.attributes.get(attribute) == value), None)

    return wait_until(find, what=f"the generation span with {attribute}={value!r}")


def _trace(receiver: Receiver, span: Span) -> dict[str, Span]:
    """Every span of ``span``'s trace by span id, once its HTTP server span is in."""

    def whole() -> dict[str, Span] | None:
        spans = {s.span_id: s for s in receiver.snapshot() if s.trace_id == span.trace_id}
        return spans if any(s.kind == ProtoSpan.SPAN_KIND_SERVER for s in spans.values()) else None

    return wait_until(whole, what="the HTTP server span")


def _children(spans: dict[str, Span], parent: Span) -> dict[str, Span]:
    return {s.name: s for s in spans.values() if s.parent_id == parent.span_id}


def _log_lines(server: ApiServer) -> list[dict]:
    lines = []
    for text in server.log_path.read_text().splitlines():
        if text.startswith("{"):
            lines.append(json.loads(text))
    return lines


def test_streamed_request_traced_with_genai_attributes(server: ApiServer, receiver: Receiver) -> None:
    tenant, key = _tenant(server)
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    model = _model(server)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    response_id = chunks[0].id

    generation = _generation_span(receiver, "gen_ai.response.id", response_id)
    assert generation.name == f"chat {model}"
    attributes = generation.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "weir"
    assert attributes["gen_ai.request.model"] == model
    assert attributes["gen_ai.request.max_tokens"] == 12
    assert attributes["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.request.seed"] == 7
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == usage.prompt_tokens_details.cached_tokens
    assert attributes["gen_ai.response.finish_reasons"] == [chunks[-2].choices[0].finish_reason]
    uncached = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
    expected_cost = uncached + 0.1 * usage.prompt_tokens_details.cached_tokens + 2 * usage.completion_tokens
    assert attributes["weir.cost_units"] == pytest.approx(expected_cost)
    assert attributes["weir.tenant"] == tenant
    assert 0 <= attributes["weir.queue_time_s"] <= attributes["weir.ttft_s"]
    assert "error.type" not in attributes
    assert "gen_ai.first_token" in generation.events

    spans = _trace(receiver, generation)
    http = spans[generation.parent_id]
    assert http.kind == ProtoSpan.SPAN_KIND_SERVER
    assert http.attributes.get("http.response.status_code", http.attributes.get("http.status_code")) == 200
    assert {"auth", generation.name} <= set(_children(spans, http))
    children = _children(spans, generation)
    assert {"reservation", "queue", "settlement"} <= set(children)
    queue = children["queue"]
    assert generation.start_ns <= queue.start_ns <= queue.end_ns <= generation.end_ns
    # the tenant's first reservation leases its quota slice from PostgreSQL: the statement traced inside it
    sql = [s for s in spans.values() if "weir_quota_acquire" in str(s.attributes.get("db.statement"))]
    assert any(s.parent_id == children["reservation"].span_id for s in sql)

    [line] = [
        line
        for line in _log_lines(server)
        if line.get("logger") == "weir.request" and line.get("request_id") == response_id
    ]
    assert line["trace_id"] == generation.trace_id
    assert (line["status"], line["output_tokens"]) == ("ok", usage.completion_tokens)
    assert line["cost"] == pytest.approx(expected_cost)
    assert line["tenant"] == attributes["weir.tenant"]


def test_refused_request_ends_with_its_reason(server: ApiServer, receiver: Receiver) -> None:
    tenant, key = _tenant(server, cost_per_minute=5, max_concurrency=4)
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    model = _model(server)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=model, prompt="Hello", max_tokens=50)

    def refused() -> Span | None:
        return next(
            (
                s
                for s in receiver.snapshot()
                if s.attributes.get("weir.tenant") == tenant and s.attributes.get("error.type")
            ),
            None,
        )

    generation = wait_until(refused, what="the refused request's generation span")
    assert generation.name == f"text_completion {model}"
    assert generation.attributes["error.type"] == "rate"
    assert generation.status_code == Status.STATUS_CODE_ERROR
    spans = _trace(receiver, generation)
    assert set(_children(spans, generation)) == {"reservation"}  # refused there: no queue, no settlement
    http = spans[generation.parent_id]
    assert http.attributes.get("http.response.status_code", http.attributes.get("http.status_code")) == 429


def test_disconnected_request_ends_cancelled(server: ApiServer, receiver: Receiver) -> None:
    _, key = _tenant(server)
    body = {"model": _model(server), "prompt": "Once upon a time", "max_tokens": LONG, "stream": True}
    chunks = []
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST", f"{server.v1}/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                break
    generation = _generation_span(receiver, "gen_ai.response.id", chunks[0]["id"])
    assert generation.attributes["error.type"] == "client_disconnected"
    assert generation.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert 3 <= generation.attributes["gen_ai.usage.output_tokens"] < LONG
    assert generation.status_code == Status.STATUS_CODE_ERROR
    children = _children(_trace(receiver, generation), generation)
    assert {"reservation", "queue", "settlement"} <= set(children)


def _metrics(server: ApiServer) -> dict[str, list]:
    """Every sample of ``GET /metrics`` (public on this server) by sample name."""
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.status_code == 200
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_need_the_admin_token_unless_public(api_server: ApiServer) -> None:
    url = f"{api_server.base_url}/metrics"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = httpx.get(url, headers=headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_admin_token"
    response = httpx.get(url, headers={"Authorization": f"Bearer {api_server.admin_token}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {"weir_engine_kv_blocks_total", "weir_ledger_backlog"} <= names


def test_metrics_count_the_requests_sent(server: ApiServer, receiver: Receiver) -> None:
    tenant, key = _tenant(server)
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    model = _model(server)
    replies = [
        client.completions.create(model=model, prompt="Count with me", max_tokens=n, temperature=0)
        for n in (3, 5, 8)
    ]
    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usages = [r.usage for r in replies] + [streamed[-1].usage]
    completions = {"weir_tenant": tenant, "gen_ai_operation_name": "text_completion"}

    def settled() -> dict[str, list] | None:
        samples = _metrics(server)
        done = _value(samples, "weir_requests_finished_total", weir_tenant=tenant)
        return samples if done == 4 else None

    samples = wait_until(settled, what="the four requests in /metrics")
    assert _value(samples, "gen_ai_server_time_to_first_token_seconds_count", **completions) == 3
    assert _value(samples, "gen_ai_server_time_to_first_token_seconds_count", weir_tenant=tenant) == 4
    assert _value(samples, "gen_ai_server_request_duration_seconds_count", weir_tenant=tenant) == 4
    # per-token time needs two tokens: every request here produced more than one
    assert _value(samples, "gen_ai_server_time_per_output_token_seconds_count", weir_tenant=tenant) == 4
    tokens = "gen_ai_client_token_usage"
    assert _value(samples, f"{tokens}_count", weir_tenant=tenant, gen_ai_token_type="input") == 4
    assert _value(samples, f"{tokens}_sum", weir_tenant=tenant, gen_ai_token_type="input") == sum(
        u.prompt_tokens for u in usages
    )
    assert _value(samples, f"{tokens}_sum", weir_tenant=tenant, gen_ai_token_type="output") == sum(
        u.completion_tokens for u in usages
    )
    cost = sum(u.prompt_tokens + 2 * u.completion_tokens for u in usages)  # nothing cached: fresh tenant
    assert _value(samples, "weir_cost_total", weir_tenant=tenant) == pytest.approx(cost)
    assert _value(samples, "weir_requests_finished_total", weir_tenant=tenant, weir_request_status="ok") == 4
    # the duration's buckets are cumulative: the +Inf bucket holds every request
    durations = "gen_ai_server_request_duration_seconds_bucket"
    assert _value(samples, durations, weir_tenant=tenant, le="+Inf") == 4

    engine = server.admin("engine")
    assert _value(samples, "weir_engine_kv_blocks_total") == engine["kv_blocks_total"]
    assert _value(samples, "weir_engine_steps_total") > 0
    assert _value(samples, "weir_engine_step_time_seconds_total") > 0
    assert "weir_ledger_backlog" in samples and "weir_ledger_spill_size_bytes" in samples

    # a refusal is counted by its reason and stage
    limited_name, limited = _tenant(server, cost_per_minute=5, max_concurrency=4)
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=server.v1, api_key=limited, max_retries=0).completions.create(
            model=model, prompt="Hello", max_tokens=50
        )
    samples = _metrics(server)
    refusals = {"weir_tenant": limited_name, "weir_refusal_reason": "rate", "weir_refusal_stage": "quota"}
    assert _value(samples, "weir_requests_refused_total", **refusals) == 1
    assert _value(samples, "gen_ai_server_request_duration_seconds_count", error_type="rate") >= 1

    # every series and label the Grafana dashboard uses exists
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    labels = {label for series in samples.values() for sample in series for label in sample.labels}
    assert set(re.findall(r"\b(?:gen_ai|weir)_[a-z_]+", exprs)) <= set(samples) | labels

    # the same meters are exported by OTLP
    wait_until(
        lambda: {"gen_ai.server.time_to_first_token", "weir.engine.kv_blocks.used"} <= receiver.metric_names,
        what="metrics exported by OTLP",
    )


def test_every_trace_starts_at_a_request(server: ApiServer, receiver: Receiver) -> None:
    """Background work's SQL (the quota sync connects every 50 ms while tenants spend, the ledger writer)
    starts no trace of its own: the only spans without a parent are HTTP server spans. Inside a request
    SQL is traced by its statements, not by the pool checkouts around them."""
    _, key = _tenant(server)
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    for _ in range(3):  # each settlement is reported by the next quota sync, outside any request
        reply = client.completions.create(model=_model(server), prompt="Tick", max_tokens=3)
        _trace(receiver, _generation_span(receiver, "gen_ai.response.id", reply.id))
    roots = [s for s in receiver.snapshot() if not s.parent_id]
    assert roots
    assert {s.kind for s in roots} == {ProtoSpan.SPAN_KIND_SERVER}, sorted({s.name for s in roots})
    names = {s.name for s in receiver.snapshot()}
    assert "connect" not in names
    assert any(s.attributes.get("db.statement") for s in receiver.snapshot()), sorted(names)


def test_refused_model_names_are_no_metric_labels(server: ApiServer, receiver: Receiver) -> None:
    """100 requests refused for free, each naming a unique 10 KB model: one ``unknown`` series, and a
    scrape under 1 MB without any of the names."""
    tenant, key = _tenant(server)
    client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
    names = [uuid.uuid4().hex + "m" * 10_000 for _ in range(100)]
    for name in names:
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=name, prompt="Hi", max_tokens=1)

    response = httpx.get(f"{server.base_url}/metrics")
    assert len(response.content) < METRICS_BYTES_BOUND
    assert [name[:32] for name in names if name[:32] in response.text] == []
    samples = _metrics(server)
    duration = "gen_ai_server_request_duration_seconds_count"
    refused = {"weir_tenant": tenant, "error_type": "model_not_found"}
    assert _value(samples, duration, gen_ai_request_model="unknown", **refused) == len(names)
    assert _value(samples, duration, **refused) == len(names)

    # the span keeps what was asked for, cut short, and is named for no tenant's text either
    generation = _generation_span(receiver, "gen_ai.request.model", names[-1][:MAX_MODEL_CHARS])
    assert generation.name == "text_completion unknown"
    assert generation.attributes["error.type"] == "model_not_found"


def test_http_metrics_carry_no_header_or_path(server: ApiServer) -> None:
    """The HTTP server metrics (old and stable conventions) are labelled by method, status, scheme and
    protocol version only: a crafted ``Host`` header and path appear nowhere in ``/metrics``."""
    marker = uuid.uuid4().hex
    statuses = "http_server_duration_milliseconds_count"
    before = _value(_metrics(server), statuses, http_status_code="401")
    response = httpx.get(f"{server.base_url}/v1/models/{marker}", headers={"Host": f"{marker}.example"})
    assert response.status_code == 401

    def counted() -> dict[str, list] | None:
        samples = _metrics(server)
        return samples if _value(samples, statuses, http_status_code="401") > before else None

    samples = wait_until(counted, what="the request in the HTTP metrics")
    assert marker not in httpx.get(f"{server.base_url}/metrics").text
    stable = {"http_response_status_code": "401", "http_request_method": "GET"}
    assert _value(samples, "http_server_request_duration_seconds_count", **stable) >= 1
    http = [sample for name, series in samples.items() if name.startswith("http_") for sample in series]
    labels = {label.replace("_", ".") for sample in http for label in sample.labels} - {"le"}
    assert labels <= {label.replace("_", ".") for label in HTTP_METRIC_ATTRIBUTES}, labels
