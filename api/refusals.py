"""The API's answers to what the tenant store and the engine refuse: each reason as its error envelope."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

from api.errors import APIError
from api.openai_format import number_text
from tenants.quotas import Refusal

log = logging.getLogger("weir.api")

_SHED_WHY = {
    "queue": "too many requests are waiting",
    "kv": "the KV cache is full and requests wait for memory",
    "slo": "the predicted time to first token exceeds the tenant's target",
    "deadline": "it could not start within the tenant's time to first token target",
}


def _retry_soon(message: str, code: str) -> APIError:
    """A 503 worth retrying after a second."""
    return APIError(503, message, type="server_error", code=code, headers={"retry-after": "1"})


def not_ready() -> APIError:
    return _retry_soon("The server is starting; retry shortly.", "not_ready")


def draining() -> APIError:
    """The 503 for a request that arrives while the server drains before it stops (``api/drain.py``); the
    connection closes after it, so that the client's retry opens one to wherever it is routed now."""
    refusal = _retry_soon(
        "The server is shutting down and takes no new requests. Please retry; another replica will serve it.",
        "server_overloaded",
    )
    refusal.headers["connection"] = "close"
    return refusal


def cut_at_shutdown() -> APIError:
    """The error of a request the server stopped unfinished because its drain timed out."""
    return _retry_soon(
        "The server shut down before your request finished. Please retry.", "server_shutting_down"
    )


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist. This server serves '{served}'.",
        param="model",
        code="model_not_found",
    )


def overloaded(reason: str, retry_after_s: float) -> APIError:
    """The 503 for a request shed for ``reason`` (queue, kv, slo, deadline)."""
    return APIError(
        503,
        f"The server is overloaded and cannot start your request in time ({_SHED_WHY[reason]}). "
        "Please retry after a short wait.",
        type="server_error",
        code="server_overloaded",
        headers={"retry-after": str(math.ceil(retry_after_s))},
    )


@contextlib.contextmanager
def database_unavailable_is_503() -> Iterator[None]:
    """A database that cannot be reached refuses the request with a retryable 503, not a 500."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

    try:
        yield
    except (DBAPIError, InterfaceError, OperationalError, OSError, TimeoutError) as exc:
        log.warning("database unavailable: %s", exc)
        raise APIError(
            503,
            "The server cannot reach its database right now; please retry shortly.",
            type="server_error",
            code="service_unavailable",
            headers={"retry-after": "2"},
        ) from None


def quota_refusal(refusal: Refusal, cost: float) -> APIError:
    """The 429 for a refused reservation; its ``x-ratelimit-*`` headers are added with every refusal's
    (``TenantStore.rate_limit_headers_on_refusal``)."""
    if refusal.reason == "budget":
        return APIError(
            429,
            "You exceeded your current quota: the monthly cost budget is spent.",
            type="insufficient_quota",
            code="insufficient_quota",
            headers={"x-should-retry": "false"},
        )
    remaining = max(0.0, refusal.remaining)
    headers = {}
    if not refusal.retryable:
        headers["x-should-retry"] = "false"
        message = (
            f"This request's worst-case cost ({cost:.0f}) exceeds the per-minute limit "
            f"({number_text(refusal.limit)}); lower max_tokens or shorten the prompt."
        )
    else:
        headers["retry-after"] = str(max(1, math.ceil(refusal.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(refusal.retry_after_s * 1000)))
        what = "cost per minute" if refusal.reason == "rate" else "concurrent requests"
        message = (
            f"Rate limit reached for {what}: limit {number_text(refusal.limit)}, remaining "
            f"{number_text(remaining)}. Please try again in {refusal.retry_after_s:.2f}s."
        )
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)
