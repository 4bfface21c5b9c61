"""CPU time of one request's telemetry in this process: the spans, metric updates and log line that
``api/tracing.py`` makes for a completed streamed chat request, with telemetry off and with it exporting
by OTLP/HTTP to a receiver (and JSON logging). Wall-clock figures over HTTP on a busy machine vary more
than telemetry costs; this counts only telemetry's own work (export threads included, flushed in the
timed window), which the HTTP benchmark cannot separate from the model's.

The HTTP server span (Litestar's middleware) and SQL spans are not in it: they come on top, one span each.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import UTC, datetime

from api import tracing
from api.metering import Job, Tracker
from api.openai_format import ResponseShape
from api.request_log import JsonFormatter
from api.schemas import ChatCompletionRequest, decode_body
from api.telemetry import Telemetry
from engine.cost import DEFAULT_WEIGHTS
from engine.types import RequestOutput, SamplingParams
from tenants.auth import Principal
from tenants.records import Quotas, Tenant

BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "stream": true}'
FLUSH_EVERY = 100  # requests between flushes: 500 spans, well inside the span queue
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 32


def _request_parts() -> tuple[ChatCompletionRequest, Principal]:
    body = decode_body(BODY, ChatCompletionRequest)
    tenant = Tenant(1, "bench", 1.0, "active", 2.0, 0.2, Quotas(), datetime.now(UTC))
    return body, Principal(key_id=1, key_prefix="wk-bench", tenant=tenant)


def _tracker(index: int) -> Tracker:
    """A streamed request that ran to its length limit, as the engine reports it."""
    request_id = f"chatcmpl-{index}"
    job = Job(
        request_id=request_id,
        tenant_id=1,
        tenant_name="bench",
        key_id=1,
        prompt_ids=[1] * PROMPT_TOKENS,
        params=SamplingParams(max_tokens=OUTPUT_TOKENS),
        shape=ResponseShape(id=request_id, chat=True, model="m"),
        stream=True,
        reservation=None,  # type: ignore[arg-type]  # not settled here
        output=None,  # type: ignore[arg-type]
    )
    tracker = Tracker(job)
    now = time.monotonic()
    times = [now - 0.05 * (OUTPUT_TOKENS - i) for i in range(OUTPUT_TOKENS)]
    tracker.update(
        RequestOutput(
            request_id,
            token_ids=[2] * OUTPUT_TOKENS,
            token_times=times,
            finished=True,
            finish_reason="length",
            prompt_tokens=PROMPT_TOKENS,
            output_tokens=OUTPUT_TOKENS,
            arrival_time=times[0] - 0.2,
            queue_time=0.1,
            first_token_time=times[0],
        )
    )
    return tracker


def _one_request(
    telemetry: Telemetry, body: ChatCompletionRequest, principal: Principal, tracker: Tracker
) -> None:
    """What the route, the tenant store and the settlement do for telemetry in one request."""
    request = tracing.begin(telemetry, "chat")
    with request.child("auth"):
        pass
    with request.generation(body, principal), tracing.reservation():
        pass
    with request.child("settlement"):
        pass
    request.finish(tracker, tracker.cost(DEFAULT_WEIGHTS))


def cpu_us_per_request(endpoint: str | None, requests: int) -> float:
    """Process CPU microseconds per request, telemetry off (``endpoint`` None) or exporting to it."""
    environ = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint} if endpoint else {}
    telemetry = Telemetry(environ=environ, trace_ids=bool(endpoint))
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - closed below
    handler.setFormatter(JsonFormatter())
    request_log = logging.getLogger("weir.request")
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO if endpoint else logging.WARNING)
    request_log.propagate = False
    body, principal = _request_parts()
    trackers = [_tracker(index) for index in range(requests + 1)]
    try:
        _one_request(telemetry, body, principal, trackers.pop())  # first-use costs out of the count
        started = time.process_time()
        for index, tracker in enumerate(trackers):
            _one_request(telemetry, body, principal, tracker)
            if index % FLUSH_EVERY == 0 and telemetry.tracer_provider is not None:
                telemetry.tracer_provider.force_flush()  # the processor drops spans past its queue of 2048
        if telemetry.tracer_provider is not None:
            telemetry.tracer_provider.force_flush()
        telemetry.meter_provider.force_flush()  # one metrics export, as every 60 s in a server
        return 1e6 * (time.process_time() - started) / requests
    finally:
        request_log.removeHandler(handler)
        handler.stream.close()
        telemetry.shutdown()
