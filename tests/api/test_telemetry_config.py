"""Telemetry configuration from the OTEL_* variables, and the bounds on labels: the tenant label's cap, the
model label's two values, the series per metric."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import OTHER_TENANTS, UNKNOWN_MODEL, TenantLabels
from api.request_log import JsonFormatter
from api.telemetry import (
    EXPORTERS,
    MAX_SERIES_PER_METRIC,
    METRICS_EXPORTERS,
    Telemetry,
    exporters_from_env,
    uninstrumented_context,
)


def _exporters(environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """(trace exporters, metric exporters) that ``environ`` configures."""
    return exporters_from_env(environ, "TRACES", EXPORTERS), exporters_from_env(
        environ, "METRICS", METRICS_EXPORTERS
    )


def test_nothing_is_exported_without_configuration() -> None:
    telemetry = Telemetry(environ={})
    assert (telemetry.trace_exporters, telemetry.metric_exporters, telemetry.tracing) == ([], [], False)
    assert b"target_info" not in telemetry.prometheus_text()  # nothing recorded yet, nothing to show


def test_an_otlp_endpoint_exports_both_signals() -> None:
    assert _exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == (["otlp"], ["otlp"])
    assert _exporters({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318"}) == (["otlp"], [])


def test_exporters_named_per_signal() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "prometheus, console",
    }
    assert _exporters(environ) == ([], ["console"])


def test_sdk_disabled_wins() -> None:
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}
    assert Telemetry(environ=environ).tracing is False


def test_trace_ids_for_logs_without_export() -> None:
    telemetry = Telemetry(environ={}, trace_ids=True)
    with telemetry.tracer.start_as_current_span("request") as span:
        assert span.get_span_context().is_valid
        assert not span.is_recording()  # numbered for the log lines, never exported


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unsupported exporter zipkin"),
        ({"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "use http/protobuf"),
    ],
)
def test_unsupported_settings_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Telemetry(environ=environ)


def test_traces_start_only_at_server_spans() -> None:
    telemetry = Telemetry(environ={"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "none"})
    finished = InMemorySpanExporter()
    assert telemetry.tracer_provider is not None
    telemetry.tracer_provider.add_span_processor(SimpleSpanProcessor(finished))
    tracer = telemetry.tracer
    with tracer.start_as_current_span("background connect", kind=SpanKind.CLIENT) as background:
        assert not background.is_recording()  # no request around it: no trace
        with tracer.start_as_current_span("background child") as child:
            assert not child.is_recording()  # the parent-based sampler follows the dropped root
    with tracer.start_as_current_span("POST /v1/completions", kind=SpanKind.SERVER) as request:
        assert request.is_recording()
        with tracer.start_as_current_span("connect", kind=SpanKind.CLIENT) as checkout:
            assert not checkout.is_recording()  # a pool checkout: dropped even inside a request
        with tracer.start_as_current_span("SELECT", kind=SpanKind.CLIENT) as sql:
            assert sql.is_recording()
    telemetry.shutdown()
    assert [span.name for span in finished.get_finished_spans()] == ["SELECT", "POST /v1/completions"]


def test_tenants_past_the_cap_are_other() -> None:
    labels = TenantLabels(cap=2)
    seen = [labels(name) for name in ("a", "b", "c", "a", "d", "b")]
    assert seen == ["a", "b", OTHER_TENANTS, "a", OTHER_TENANTS, "b"]


def test_the_model_label_is_the_served_name_or_unknown() -> None:
    labels = Telemetry(environ={}, served_model=lambda: "smol").metrics.model
    named = [labels(name) for name in ("smol", "gpt-4o", "smol ", "x" * 10_000)]
    assert named == ["smol", UNKNOWN_MODEL, UNKNOWN_MODEL, UNKNOWN_MODEL]


def test_a_metric_holds_at_most_2000_series_and_one_overflow() -> None:
    assert MAX_SERIES_PER_METRIC == 2_000
    telemetry = Telemetry(environ={})
    for n in range(MAX_SERIES_PER_METRIC + 500):
        telemetry.metrics.refused.add(1, {"weir.refusal.reason": f"r{n}"})
    [family] = [
        family
        for family in text_string_to_metric_families(telemetry.prometheus_text().decode())
        if family.name == "weir_requests_refused"
    ]
    series = [sample for sample in family.samples if sample.name == "weir_requests_refused_total"]
    assert len(series) == MAX_SERIES_PER_METRIC + 1
    assert [s.value for s in series if s.labels.get("otel_metric_overflow") == "true"] == [500]
    telemetry.shutdown()


def test_json_lines_carry_the_trace_id_inside_a_span() -> None:
    telemetry = Telemetry(environ={}, trace_ids=True)
    formatter = JsonFormatter()
    fields = {"name": "weir.api", "levelname": "INFO", "msg": "hello %s", "args": ("x",)}
    record = logging.makeLogRecord(fields)
    assert "trace_id" not in json.loads(formatter.format(record))
    with telemetry.tracer.start_as_current_span("request") as span:
        record.tenant = "acme"
        line = json.loads(formatter.format(record))
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert (line["message"], line["level"], line["tenant"]) == ("hello x", "info", "acme")


def test_background_context_turns_instrumentation_off() -> None:
    """The context the store's background work runs in when SQL is traced: instrumentations stay out of
    it, and only of it."""
    context = uninstrumented_context()
    assert context.run(is_instrumentation_enabled) is False
    assert is_instrumentation_enabled()
