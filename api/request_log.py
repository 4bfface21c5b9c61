"""The server's log lines: text (the default) or JSON objects, one a line (``weir serve --log-format json``).

In JSON every line carries the trace and span id of the request it was written in, and each completion
request ends with one ``request finished`` line from the ``weir.request`` logger with its numbers.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
REQUEST_LOGGER = "weir.request"
_request_log = logging.getLogger(REQUEST_LOGGER)
# a record's own attributes, and uvicorn's colored copy of its message
_STANDARD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, trace ids, and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            line["trace_id"] = format(span.trace_id, "032x")
            line["span_id"] = format(span.span_id, "016x")
        line |= {key: value for key, value in vars(record).items() if key not in _STANDARD_FIELDS}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(log_format: str, level: str) -> None:
    """The root logger's one handler on stderr, in ``log_format``; the request lines only in JSON."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(levelname)-8s %(name)s: %(message)s"))
    _request_log.disabled = log_format != "json"
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def log_request(fields: dict[str, Any]) -> None:
    """The finished request's line (id, tenant, status, tokens, cost, timings)."""
    if _request_log.isEnabledFor(logging.INFO):
        _request_log.info("request finished", extra=fields)
