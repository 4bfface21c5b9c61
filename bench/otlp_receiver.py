"""A small OTLP/HTTP receiver, standing in for a collector in the telemetry benchmark and tests: it accepts
protobuf exports of spans and metrics and keeps them decoded."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def plain(value: AnyValue) -> Any:
    """An OTLP attribute value as a Python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    events: list[str]
    status_code: int
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    endpoint: str
    spans: list[Span] = field(default_factory=list)
    metric_names: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def add_traces(self, request: ExportTraceServiceRequest) -> None:
        spans = [
            Span(
                name=span.name,
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_id=span.parent_span_id.hex(),
                kind=span.kind,
                attributes={a.key: plain(a.value) for a in span.attributes},
                events=[event.name for event in span.events],
                status_code=span.status.code,
                start_ns=span.start_time_unix_nano,
                end_ns=span.end_time_unix_nano,
            )
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self.lock:
            self.spans.extend(spans)

    def add_metrics(self, request: ExportMetricsServiceRequest) -> None:
        names = {
            metric.name
            for resource in request.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }
        with self.lock:
            self.metric_names |= names


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiver on a free local port; its ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes."""
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server interface
            body = self.rfile.read(int(self.headers["content-length"]))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/traces":
                receiver.add_traces(ExportTraceServiceRequest.FromString(body))
            elif self.path == "/v1/metrics":
                receiver.add_metrics(ExportMetricsServiceRequest.FromString(body))
            else:
                self.send_error(404)
                return
            reply = ExportTraceServiceResponse().SerializeToString()  # every Export*Response is empty
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
