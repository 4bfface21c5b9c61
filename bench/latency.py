"""Per-request latency records of an online load and their summary: percentiles, throughput, goodput."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one streamed request (times from ``time.perf_counter()``)."""

    sent: float
    status: int | None = None  # HTTP status; None when the connection failed
    error: str | None = None  # transport error or an error event inside the stream
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk carrying text
    done: float | None = None  # the end of the stream, or when a refusal was answered
    text: str = ""  # the answer's text, as streamed
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server says it took from its cache
    finish_reason: str | None = None
    skipped: bool = False  # never sent: an earlier turn of its conversation failed
    refusal: str | None = None  # a refused request's error code (the body's ``error.code``), if it gave one

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.done is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.ok and self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if not self.ok or not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def refused(self) -> bool:
        """Answered with an HTTP status other than 200."""
        return self.status is not None and self.status != 200

    @property
    def e2e(self) -> float | None:
        return self.done - self.sent if self.ok else None

    def itls(self) -> list[float]:
        return (
            [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)] if self.ok else []
        )

    def meets(self, slo_ttft: float, slo_tpot: float) -> bool:
        ttft, tpot = self.ttft, self.tpot
        return ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms_summary(values: Sequence[float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {f"p{q}": ms(percentile(values, q)) for q in PERCENTILES}
    summary["mean"] = ms(sum(values) / len(values)) if values else None
    return summary


def ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds rounded to 0.01 (None stays None)."""
    return None if seconds is None else round(seconds * 1000, 2)


def summarize(records: Sequence[RequestRecord], slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """The figures of one run: latency percentiles (ms), throughput, goodput, refusals by status, and the
    share of prompt tokens the server took from its cache (None when it does not say).

    The run's duration spans from the first request sent to the last one ended, whatever its outcome.
    Skipped requests (never sent) count in the SLO attainment's denominator but not as refusals.
    """
    if not records:
        raise ValueError("no requests to summarize")
    ok = [r for r in records if r.ok]
    ends = [r.done or r.sent for r in records]
    duration = max(max(ends) - min(r.sent for r in records), 1e-9)
    good = sum(r.meets(slo_ttft_s, slo_tpot_s) for r in ok)
    refused = Counter(
        str(r.status) if r.status is not None else "connection"
        for r in records
        if r.status != 200 and not r.skipped
    )
    failed = sum(1 for r in records if r.status == 200 and not r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed_in_stream": failed,
        "refused": dict(sorted(refused.items())),
        "refused_total": sum(refused.values()),
        "skipped": sum(1 for r in records if r.skipped),
        "duration_s": round(duration, 3),
        "request_throughput_rps": round(len(ok) / duration, 4),
        "output_tokens_per_s": round(output_tokens / duration, 3),
        "goodput_rps": round(good / duration, 4),
        "slo_attainment": round(good / len(records), 4),
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "cached_pct": round(100 * sum(cached) / prompt_tokens, 2) if cached and prompt_tokens else None,
        "ended_by_stop": sum(1 for r in ok if r.finish_reason == "stop"),
        "ttft_ms": _ms_summary([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _ms_summary([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _ms_summary([gap for r in ok for gap in r.itls()]),
        "e2e_ms": _ms_summary([r.e2e for r in ok if r.e2e is not None]),
    }
