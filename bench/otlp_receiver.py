"""A small OTLP/HTTP receiver, standing in for a collector in the telemetry benchmark and tests: it accepts
protobuf exports of spans and metrics and decodes them.

It listens in a process of its own, which only writes each payload to a file, and the payloads are decoded
when they are read (``Receiver.snapshot``, ``Receiver.metric_names``). A collector does not share the
client's interpreter: a receiver thread in the benchmark's process would hold its load generator's GIL
while decoding an export, and delay the first tokens it times from the server that exports.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

REPO_ROOT = Path(__file__).resolve().parent.parent
SIGNALS = {"/v1/traces": "traces", "/v1/metrics": "metrics"}  # request path -> payload file suffix
START_TIMEOUT_S = 30.0


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
    """The parent's view of the receiving process: its endpoint and what it has received, decoded."""

    endpoint: str
    directory: Path
    spans: list[Span] = field(default_factory=list)
    _metric_names: set[str] = field(default_factory=set)
    _read: set[str] = field(default_factory=set)  # payload files already decoded
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[Span]:
        """Every span received so far."""
        with self.lock:
            self._decode_new()
            return list(self.spans)

    @property
    def metric_names(self) -> set[str]:
        """The names of every metric received so far."""
        with self.lock:
            self._decode_new()
            return set(self._metric_names)

    def _decode_new(self) -> None:
        for path in sorted(self.directory.glob("*.pb"), key=lambda p: int(p.stem.split(".")[0])):
            if path.name in self._read:
                continue
            self._read.add(path.name)
            body = path.read_bytes()
            if path.stem.endswith(".traces"):
                self._add_traces(ExportTraceServiceRequest.FromString(body))
            else:
                self._add_metrics(ExportMetricsServiceRequest.FromString(body))

    def _add_traces(self, request: ExportTraceServiceRequest) -> None:
        self.spans.extend(
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
        )

    def _add_metrics(self, request: ExportMetricsServiceRequest) -> None:
        self._metric_names |= {
            metric.name
            for resource in request.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """A receiving process on a free local port; the ``endpoint`` is what ``OTEL_EXPORTER_OTLP_ENDPOINT``
    takes."""
    with tempfile.TemporaryDirectory(prefix="weir-otlp-") as directory:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.otlp_receiver", directory],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = _read_port(process)
            yield Receiver(f"http://127.0.0.1:{port}", Path(directory))
        finally:
            process.terminate()
            process.wait(timeout=START_TIMEOUT_S)


def _read_port(process: subprocess.Popen) -> int:
    """The port the receiving process announced on its first line of output."""
    timer = threading.Timer(START_TIMEOUT_S, process.kill)
    timer.start()
    try:
        line = process.stdout.readline() if process.stdout else ""
    finally:
        timer.cancel()
    if not line.startswith("port "):
        raise RuntimeError(f"the OTLP receiver did not start (exit status {process.poll()})")
    return int(line.split()[1])


def serve(directory: Path) -> None:
    """Receive exports on a free local port until terminated, each payload written (decompressed) to
    ``directory`` as ``<sequence>.<signal>.pb``; the port is printed first."""
    sequence = itertools.count(1)  # next() on it is atomic: the handler threads need no lock

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the http.server interface
            body = self.rfile.read(int(self.headers["content-length"]))
            signal = SIGNALS.get(self.path)
            if signal is None:
                self.send_error(404)
                return
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            number = next(sequence)
            partial = directory / f"{number}.{signal}.part"
            partial.write_bytes(body)
            partial.rename(directory / f"{number}.{signal}.pb")  # whole once it has its name
            reply = ExportTraceServiceResponse().SerializeToString()  # every Export*Response is empty
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"port {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an OTLP/HTTP receiver that keeps each payload in a file")
    parser.add_argument("directory", type=Path)
    serve(parser.parse_args().directory)
