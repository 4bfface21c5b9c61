"""OpenTelemetry for one ``weir serve`` process, configured by the standard ``OTEL_*`` variables.

With none of them set, nothing is exported: no tracer provider exists (spans are the API's no-op ones),
and the only metric reader is the Prometheus one behind ``GET /metrics``, which works only when scraped.
The rules for each variable are in docs/telemetry.md. Every metric holds at most ``MAX_SERIES_PER_METRIC``
attribute sets (then one overflow series), and the HTTP server metrics only the attributes in
``HTTP_METRIC_ATTRIBUTES``, none of which is a request header or path.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    ObservableCounter,
    ObservableGauge,
    ObservableUpDownCounter,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision, Sampler, SamplingResult
from opentelemetry.trace import SpanKind, get_current_span
from prometheus_client import CollectorRegistry, generate_latest

from api.metrics import Metrics
from tenants.background import run_background_in

if TYPE_CHECKING:
    from pathlib import Path

    from opentelemetry.context import Context
    from opentelemetry.trace import Link, TraceState
    from opentelemetry.util.types import Attributes

    from api.tenant_store import TenantStore
    from engine.types import EngineStats

log = logging.getLogger("weir.telemetry")

SCOPE = "weir"
DEFAULT_SERVICE_NAME = "weir"
EXPORTERS = {"otlp", "console", "none"}
METRICS_EXPORTERS = EXPORTERS | {"prometheus"}  # prometheus: GET /metrics, served in any case
POOL_CHECKOUT_SPAN = "connect"  # the SQLAlchemy instrumentation's span around ``Engine.connect``
MAX_SERIES_PER_METRIC = 2_000  # attribute sets per metric; later ones share one otel_metric_overflow series
HTTP_METER = "opentelemetry.instrumentation.asgi"  # the meter of Litestar's OpenTelemetry middleware
# The HTTP server metrics' attributes, old and stable semantic conventions: each from a small fixed set
# (a method outside the standard ones is _OTHER). Left out: http.host, http.server_name, net.host.name (the
# Host header), http.target, url.* and http.route (Litestar's route attribute is the path sent: its
# middleware runs before routing).
HTTP_METRIC_ATTRIBUTES = frozenset(
    {
        "http.method",
        "http.scheme",
        "http.flavor",
        "http.status_code",
        "http.request.method",
        "http.response.status_code",
        "network.protocol.version",
        "url.scheme",
        "error.type",
    }
)
_SERIES_LIMITS = {  # every kind of instrument Weir and the HTTP middleware make
    kind: MAX_SERIES_PER_METRIC
    for kind in (
        Counter,
        UpDownCounter,
        Histogram,
        ObservableCounter,
        ObservableUpDownCounter,
        ObservableGauge,
    )
}


def exporters_from_env(environ: Mapping[str, str], signal: str, allowed: set[str]) -> list[str]:
    """The exporters ``OTEL_{signal}_EXPORTER`` names; unset, OTLP when an OTLP endpoint is configured."""
    value = environ.get(f"OTEL_{signal}_EXPORTER", "").strip()
    if not value:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(
            f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - allowed)
    if unknown:
        raise ValueError(
            f"OTEL_{signal}_EXPORTER: unsupported exporter {', '.join(unknown)} "
            f"(supported: {', '.join(sorted(allowed))})"
        )
    return [name for name in names if name not in ("none", "prometheus")]


def _check_protocol(environ: Mapping[str, str], signal: str) -> None:
    protocol = environ.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        raise ValueError(f"OTLP protocol {protocol!r} is not supported; use http/protobuf")


def check_environment(environ: Mapping[str, str]) -> None:
    """``ValueError`` naming the first ``OTEL_*`` setting Weir cannot follow (an exporter, a protocol)."""
    for signal, allowed in (("TRACES", EXPORTERS), ("METRICS", METRICS_EXPORTERS)):
        if "otlp" in exporters_from_env(environ, signal, allowed):
            _check_protocol(environ, signal)


class RequestsOnly(Sampler):
    """Traces start at a request: a span with no parent that is not a server span (the SQL of background
    work: quota syncs every 50 ms while tenants spend, the ledger writer's batches) is dropped, and so is
    the SQLAlchemy instrumentation's ``connect`` span (a pool checkout: microseconds, and nothing its
    statements' spans do not carry); every other span is left to ``sampler`` (``OTEL_TRACES_SAMPLER``'s)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def should_sample(  # noqa: PLR0913 - the Sampler interface
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if name == POOL_CHECKOUT_SPAN and kind is SpanKind.CLIENT:
            return SamplingResult(Decision.DROP)
        if kind is not SpanKind.SERVER and not get_current_span(parent_context).get_span_context().is_valid:
            return SamplingResult(Decision.DROP)
        sampler = self.sampler
        return sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"RequestsOnly{{{self.sampler.get_description()}}}"


class Telemetry:
    """The tracer and meter providers of one process and what they export to."""

    def __init__(
        self,
        *,
        environ: Mapping[str, str] | None = None,
        trace_ids: bool = False,
        max_tenants: int = 100,
        served_model: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``trace_ids``: make trace ids for log lines even when no trace is exported; ``served_model``:
        the name of the model served (the only model label other than ``unknown``)."""
        environ = os.environ if environ is None else environ
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            environ = {}
        resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME})
        self.trace_exporters = exporters_from_env(environ, "TRACES", EXPORTERS)
        self.metric_exporters = exporters_from_env(environ, "METRICS", METRICS_EXPORTERS)
        self.registry = CollectorRegistry(auto_describe=True)
        prometheus = PrometheusMetricReader(
            registry=self.registry, scope_info_enabled=False, cardinality_limits=_SERIES_LIMITS
        )
        readers: list[MetricReader] = [prometheus]
        for name in self.metric_exporters:
            exporter = _metric_exporter(name, environ)
            readers.append(PeriodicExportingMetricReader(exporter, cardinality_limits=_SERIES_LIMITS))
        http = View(meter_name=HTTP_METER, instrument_name="*", attribute_keys=set(HTTP_METRIC_ATTRIBUTES))
        self.meter_provider = MeterProvider(metric_readers=readers, resource=resource, views=[http])
        self.meter = self.meter_provider.get_meter(SCOPE)
        self.metrics = Metrics(self.meter, max_tenants, served_model)
        self.tracer_provider: TracerProvider | None = None
        if self.trace_exporters or trace_ids:
            sampler = None if self.trace_exporters else ALWAYS_OFF  # None: OTEL_TRACES_SAMPLER decides
            self.tracer_provider = TracerProvider(resource=resource, sampler=sampler)
            if self.trace_exporters:
                self.tracer_provider.sampler = RequestsOnly(self.tracer_provider.sampler)
            for name in self.trace_exporters:
                self.tracer_provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, environ)))
        provider = self.tracer_provider or trace.NoOpTracerProvider()
        self.tracer = provider.get_tracer(SCOPE)

    @property
    def tracing(self) -> bool:
        """Whether spans are made (exported, or only numbered for log lines)."""
        return self.tracer_provider is not None

    def describe(self) -> str:
        traces = ", ".join(self.trace_exporters) or "none"
        metrics = ", ".join(["prometheus (/metrics)", *self.metric_exporters])
        return f"telemetry: traces to {traces}; metrics to {metrics}"

    def prometheus_text(self) -> bytes:
        """Every metric in Prometheus' text exposition format."""
        return generate_latest(self.registry)

    def observe(self, stats: Callable[[], EngineStats], store: TenantStore, spill_dir: Path) -> None:
        """Start reading the engine's stats and the ledger's backlog and spill files into gauges, and
        tracing the store's SQL statements (on each of its engines) when traces are exported."""
        self.metrics.observe_engine(self.meter, stats)
        self.metrics.observe_ledger(self.meter, store.ledger_backlog, spill_dir)
        if not self.trace_exporters:
            return
        from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

        run_background_in(uninstrumented_context())
        SQLAlchemyInstrumentor().instrument(
            engines=[engine.sync_engine for engine in store.engines()],
            tracer_provider=self.tracer_provider,
            meter_provider=NoOpMeterProvider(),  # no pool-usage counter updated at every checkout and checkin
            skip_dep_check=True,  # it names SQLAlchemy < 2.1; the engine events it uses are unchanged in 2.1
        )

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporters."""
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def uninstrumented_context() -> contextvars.Context:
    """A fresh context in which OpenTelemetry's instrumentations record nothing: the store's background
    SQL (a quota sync every 50 ms while tenants spend) then skips the SQLAlchemy instrumentation's work,
    which the sampler would only throw away, on the event loop the requests share."""

    def suppressed() -> contextvars.Context:
        with suppress_instrumentation():
            return contextvars.copy_context()

    return contextvars.Context().run(suppressed)


def _otlp_endpoint(environ: Mapping[str, str], signal: str) -> str | None:
    """The signal's OTLP/HTTP URL: its own variable as given, else the base endpoint + ``/v1/<signal>``."""
    own = environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return own or (f"{base.rstrip('/')}/v1/{signal.lower()}" if base else None)


def _span_exporter(name: str, environ: Mapping[str, str]):
    if name == "console":
        return ConsoleSpanExporter()
    _check_protocol(environ, "TRACES")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=_otlp_endpoint(environ, "TRACES"))


def _metric_exporter(name: str, environ: Mapping[str, str]):
    if name == "console":
        return ConsoleMetricExporter()
    _check_protocol(environ, "METRICS")
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=_otlp_endpoint(environ, "METRICS"))
