"""One completion request's telemetry: its spans, its metrics and its log line (docs/telemetry.md).

The route starts a ``RequestTrace`` and makes it the request's current one (a context variable, so the
quota and settlement code, and the settlement task, reach it without being handed it). Inside the HTTP
server span it makes an ``auth`` span, then the generation span ``chat {model}`` or ``text_completion
{model}`` with its children: ``reservation`` (where quota refusals end it), ``queue`` (from the engine's own
timestamps) and ``settlement``, and a ``gen_ai.first_token`` event. The generation span stays open after
the route returns, while the response streams, and ends when the request is settled.

``{model}`` in the span name and in metric labels is the served model's name, or ``unknown`` for any other
model string; the string the request sent is kept, cut to ``MAX_MODEL_CHARS``, in the span's
``gen_ai.request.model`` and the log line.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from opentelemetry import context, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from api.errors import APIError
from api.metrics import TENANT
from api.request_log import log_request

if TYPE_CHECKING:
    from api.metering import Tracker
    from api.schemas import SamplingFields
    from api.telemetry import Telemetry
    from engine.cost import CostWeights
    from tenants.auth import Principal

PROVIDER = "weir"
MAX_MODEL_CHARS = 256  # of a requested model name in a span attribute or a log line (the ledger's limit)
_current: ContextVar[RequestTrace | None] = ContextVar("weir_request_trace", default=None)


def begin(telemetry: Telemetry, operation: str) -> RequestTrace:
    """Start the telemetry of the request being handled (``operation``: chat or text_completion)."""
    request = RequestTrace(telemetry, operation)
    _current.set(request)
    return request


def refused(reason: str) -> None:
    """The current request was refused for ``reason`` (rate, concurrency, budget, queue, kv, slo)."""
    request = _current.get()
    if request is not None:
        request.refused(reason)


@contextlib.contextmanager
def reservation() -> Iterator[None]:
    """A ``reservation`` span around the current request's quota reservation."""
    request = _current.get()
    if request is None:
        yield
        return
    with request.child("reservation"):
        yield


async def settled(settlement: Awaitable[None], tracker: Tracker, weights: CostWeights) -> None:
    """Run ``settlement`` in a ``settlement`` span, then end the request's telemetry."""
    request = _current.get()
    if request is None:
        await settlement
        return
    with request.child("settlement"):
        await settlement
    request.finish(tracker, 0.0 if tracker.refused else tracker.cost(weights))


def _epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as nanoseconds since the epoch (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTrace:
    """The spans, metric attributes and log fields of one completion request."""

    def __init__(self, telemetry: Telemetry, operation: str) -> None:
        self.telemetry = telemetry
        self.operation = operation
        self.started = time.monotonic()
        self.span: Span = trace.INVALID_SPAN
        self.tenant = ""
        self.model = ""  # as requested, cut to MAX_MODEL_CHARS
        self.model_label = ""  # the served model's name or "unknown"
        self.error_type: str | None = None

    @contextlib.contextmanager
    def child(self, name: str) -> Iterator[Span]:
        """A child span of the generation span (or of the current span before it starts)."""
        parent = trace.set_span_in_context(self.span) if self.span.is_recording() else None
        with self.telemetry.tracer.start_as_current_span(name, context=parent) as span:
            yield span

    @contextlib.contextmanager
    def generation(self, body: SamplingFields, principal: Principal) -> Iterator[None]:
        """The generation span, current inside; a refusal or error raised inside ends it and the request."""
        self.tenant, self.model = principal.tenant_name, body.model[:MAX_MODEL_CHARS]
        self.model_label = self.telemetry.metrics.model(body.model)
        name, attributes = f"{self.operation} {self.model_label}", self._request_attributes(body)
        self.span = self.telemetry.tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attributes)
        self.span.set_attribute(TENANT, principal.tenant_name)
        token = context.attach(trace.set_span_in_context(self.span))
        try:
            yield
        except BaseException as exc:
            self.error_type = self.error_type or _error_type(exc)
            self.span.set_attribute("error.type", self.error_type)
            self.span.set_status(Status(StatusCode.ERROR, self.error_type))  # the message may quote input
            self._record(self._metric_attributes())
            self.span.end()
            log_request(self._log_fields(status="refused"))
            raise
        finally:
            context.detach(token)

    def _request_attributes(self, body: SamplingFields) -> dict[str, Any]:
        attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self.model,
            "gen_ai.request.stream": bool(body.stream),
        }
        optional = {
            "gen_ai.request.max_tokens": body.requested_max_tokens(),
            "gen_ai.request.temperature": body.temperature,
            "gen_ai.request.top_p": body.top_p,
            "gen_ai.request.seed": body.seed,
        }
        return attributes | {name: value for name, value in optional.items() if value is not None}

    def refused(self, reason: str) -> None:
        self.error_type = reason
        self.telemetry.metrics.record_refusal(self.tenant, reason)

    def _metric_attributes(self) -> dict[str, str]:
        attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": self.model_label,
            TENANT: self.telemetry.metrics.tenant(self.tenant),
        }
        if self.error_type is not None:
            attributes["error.type"] = self.error_type
        return attributes

    def _record(self, attributes: dict[str, str], tracker: Tracker | None = None) -> None:
        metrics = self.telemetry.metrics
        metrics.duration.record(time.monotonic() - self.started, attributes)
        if tracker is None:
            return
        timings = tracker.timings()
        if timings["ttft_s"] is not None:
            metrics.ttft.record(timings["ttft_s"], attributes)
        if timings["tpot_s"] is not None:
            metrics.tpot.record(timings["tpot_s"], attributes)
        if timings["queue_s"] is not None:
            metrics.queue_time.record(timings["queue_s"], attributes)
        metrics.tokens.record(tracker.prompt_tokens, attributes | {"gen_ai.token.type": "input"})
        metrics.tokens.record(tracker.total.output_tokens, attributes | {"gen_ai.token.type": "output"})

    def finish(self, tracker: Tracker, cost: float) -> None:
        """End the request: response attributes, the queue span and first-token event, metrics, log line.
        A request refused unstarted (its start deadline passed) counts only as a refusal (``refused``)."""
        status, finish_reason = ("refused", tracker.finish_reason) if tracker.refused else tracker.outcome()
        if status not in ("ok", "refused"):
            self.error_type = _ending(tracker)
        attributes = self._metric_attributes()
        if tracker.refused:
            self._record(attributes)
        else:
            self._record(attributes, tracker)
            metrics = self.telemetry.metrics
            metrics.cost.add(cost, {TENANT: attributes[TENANT]})
            metrics.request_cost.record(cost, {TENANT: attributes[TENANT]})
            metrics.finished.add(1, attributes | {"weir.request.status": status})
        if self.span.is_recording():
            self._end_span(tracker, cost)
        log_request(self._log_fields(tracker, cost, status, finish_reason))

    def _end_span(self, tracker: Tracker, cost: float) -> None:
        span, job, total, timings = self.span, tracker.job, tracker.total, tracker.timings()
        if total.arrival_time is not None and total.queue_time is not None:
            start = _epoch_ns(total.arrival_time)
            queue = self.telemetry.tracer.start_span(
                "queue", context=trace.set_span_in_context(span), start_time=start
            )
            queue.end(end_time=start + int(total.queue_time * 1e9))
        if total.first_token_time is not None:
            span.add_event("gen_ai.first_token", timestamp=_epoch_ns(total.first_token_time))
        attributes = {
            "gen_ai.response.id": job.request_id,
            "gen_ai.response.model": self.model_label,
            "gen_ai.response.finish_reasons": [tracker.finish_reason or "error"],
            "gen_ai.usage.input_tokens": tracker.prompt_tokens,
            "gen_ai.usage.output_tokens": total.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": total.cached_tokens,
            "gen_ai.request.max_tokens": job.params.max_tokens,
            "weir.cost_units": cost,
            "weir.queue_time_s": timings["queue_s"],
            "weir.ttft_s": timings["ttft_s"],
        }
        span.set_attributes({name: value for name, value in attributes.items() if value is not None})
        if self.error_type is not None:
            span.set_attribute("error.type", self.error_type)
            span.set_status(Status(StatusCode.ERROR, self.error_type))
        span.end()

    def _log_fields(
        self,
        tracker: Tracker | None = None,
        cost: float = 0.0,
        status: str = "refused",
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "request_id": tracker.job.request_id if tracker else None,
            "operation": self.operation,
            "model": self.model,
            "tenant": self.tenant,
            "status": status,
            "finish_reason": finish_reason,
            "error_type": self.error_type,
            "prompt_tokens": tracker.prompt_tokens if tracker else 0,
            "cached_tokens": tracker.total.cached_tokens if tracker else 0,
            "output_tokens": tracker.total.output_tokens if tracker else 0,
            "cost": cost,
        }
        if tracker is not None:
            fields |= tracker.timings()
        else:
            fields["e2e_s"] = time.monotonic() - self.started
        return fields


def _ending(tracker: Tracker) -> str:
    """``error.type`` of an admitted request that did not end normally."""
    if tracker.dropped:
        return "client_timeout"
    if tracker.disconnected:
        return "client_disconnected"
    if tracker.finish_reason == "abort":
        return "aborted"
    return "engine_error"


def _error_type(exc: BaseException) -> str:
    """``error.type`` of a request refused before it was admitted: its error code, else its status."""
    if isinstance(exc, APIError):
        return exc.code or str(exc.status)
    return type(exc).__name__
