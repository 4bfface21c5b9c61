"""The process's metric instruments: the GenAI semantic-convention histograms and Weir's own counters and
gauges. No label value is a request's own text: the tenant label's cardinality is capped and the model
label is the served model's name or ``unknown`` (docs/telemetry.md, "Metrics")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation

from engine.types import EngineStats

# The GenAI semantic conventions' recommended bucket boundaries.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, ... 67108864
COST_BUCKETS = (1.0, 10.0, 100.0, 1_000.0, 10_000.0, 100_000.0, 1_000_000.0)

TENANT = "weir.tenant"
OTHER_TENANTS = "other"
UNKNOWN_MODEL = "unknown"
QUOTA_REASONS = frozenset({"rate", "concurrency", "budget"})  # the rest (queue, kv, slo) are admission's


class TenantLabels:
    """The ``weir.tenant`` label value: a tenant's name for the first ``cap`` tenants this process serves,
    ``other`` for every later one, so that a platform with many tenants cannot explode the series count."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.cap:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class ModelLabels:
    """The ``gen_ai.request.model`` label value: the served model's name when a request names it, else
    ``unknown``, so that the model strings of requests refused for free cannot add series."""

    def __init__(self, served: Callable[[], str | None]) -> None:
        self._served = served

    def __call__(self, requested: str) -> str:
        return requested if requested == self._served() else UNKNOWN_MODEL


class Metrics:
    """Every instrument Weir records; the observable ones read the engine's stats and the ledger writer."""

    def __init__(self, meter: Meter, max_tenants: int, served_model: Callable[[], str | None]) -> None:
        self.tenant = TenantLabels(max_tenants)
        self.model = ModelLabels(served_model)
        new = partial(_histogram, meter)
        self.ttft = new("gen_ai.server.time_to_first_token", TTFT_BUCKETS, "Engine arrival to first token")
        self.tpot = new("gen_ai.server.time_per_output_token", TPOT_BUCKETS, "Mean time per later token")
        self.duration = new("gen_ai.server.request.duration", DURATION_BUCKETS, "Time per request")
        self.tokens = new("gen_ai.client.token.usage", TOKEN_BUCKETS, "Tokens per request by type", "{token}")
        self.queue_time = new("weir.request.queue_time", TTFT_BUCKETS, "Engine arrival to first step")
        self.request_cost = new("weir.request.cost", COST_BUCKETS, "Cost units per request", "{cost_unit}")
        self.cost = meter.create_counter(
            "weir.cost", unit="{cost_unit}", description="Cost units charged to tenants"
        )
        self.finished = meter.create_counter(
            "weir.requests.finished",
            unit="{request}",
            description="Admitted requests by how they ended (weir.request.status: ok, cancelled, error)",
        )
        self.refused = meter.create_counter(
            "weir.requests.refused",
            unit="{request}",
            description="Requests refused by weir.refusal.reason; weir.refusal.stage is quota or admission",
        )

    def record_refusal(self, tenant: str, reason: str) -> None:
        stage = "quota" if reason in QUOTA_REASONS else "admission"
        attributes = {TENANT: self.tenant(tenant), "weir.refusal.reason": reason, "weir.refusal.stage": stage}
        self.refused.add(1, attributes)

    def observe_engine(self, meter: Meter, stats: Callable[[], EngineStats]) -> None:
        """Gauges and counters read from the engine's stats snapshot at each collection."""

        def gauge(read: Callable[[EngineStats], float]) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def callback(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(read(stats()))]

            return callback

        meter.create_observable_gauge(
            "weir.engine.requests.running", [gauge(lambda s: s.running)], unit="{request}"
        )
        meter.create_observable_gauge(
            "weir.engine.requests.waiting", [gauge(lambda s: s.waiting)], unit="{request}"
        )
        used = gauge(lambda s: s.kv_blocks_total - s.kv_blocks_free)
        meter.create_observable_gauge("weir.engine.kv_blocks.used", [used], unit="{block}")
        meter.create_observable_gauge(
            "weir.engine.kv_blocks.total", [gauge(lambda s: s.kv_blocks_total)], unit="{block}"
        )
        meter.create_observable_counter(
            "weir.engine.preemptions", [gauge(lambda s: s.preemptions)], unit="{preemption}"
        )
        meter.create_observable_counter("weir.engine.steps", [gauge(lambda s: s.steps)], unit="{step}")
        meter.create_observable_counter(
            "weir.engine.step_time",
            [gauge(lambda s: s.step_seconds)],
            unit="s",
            description="Seconds spent in engine steps; over weir.engine.steps, the mean step time",
        )

    def observe_ledger(self, meter: Meter, pending: Callable[[], int], spill_dir: Path) -> None:
        """The usage writer's backlog (events not yet written or spilled) and its spill files' size."""

        def backlog(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(pending())]

        def spill_bytes(_: CallbackOptions) -> Iterable[Observation]:
            files = spill_dir.glob("*.jsonl") if spill_dir.is_dir() else ()
            return [Observation(sum(_size(path) for path in files))]

        meter.create_observable_gauge("weir.ledger.backlog", [backlog], unit="{event}")
        meter.create_observable_gauge("weir.ledger.spill.size", [spill_bytes], unit="By")


def _histogram(
    meter: Meter, name: str, buckets: tuple[float, ...], description: str, unit: str = "s"
) -> Histogram:
    return meter.create_histogram(
        name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
    )


def _size(path: Path) -> int:
    """A file's size; 0 for one removed meanwhile (a spill file replayed)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
