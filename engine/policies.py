"""Scheduling policies: which waiting request goes next, which running one is preempted.

The scheduler asks the policy these two questions and tells it what happened (arrivals, tokens served,
finishes) through the hooks, so a weighted fair-share policy keeping per-tenant virtual cost counters fits
without touching the scheduler.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from engine.cost import DEFAULT_WEIGHTS, CostWeights
from engine.sequence import Sequence

SHARE_HALF_LIFE_S = 20.0  # recent service, for ``share_ratio``, halves every this many seconds
SHARE_WINDOW_S = 60.0  # a tenant that sent or was served within this long shares the service
ARRIVAL_HALF_LIFE_S = 5.0  # a tenant's recent prompt arrivals, for its arrival rate, halve this often


class Policy:
    """The scheduler's source of ordering decisions; subclasses answer the two questions."""

    name: str

    def pick_next(self, waiting: Seq[Sequence], planned: Mapping[str, int] | None = None) -> Sequence:
        """The sequence whose prefill is served next, among waiting requests and running prompts still
        being prefilled (``waiting`` is never empty); ``planned`` is the prefill tokens per tenant already
        planned in the step being built (charged only once it has run)."""
        raise NotImplementedError

    def pick_victim(self, candidates: Seq[Sequence]) -> Sequence:
        """The running sequence to preempt when KV blocks run out (``candidates`` is never empty)."""
        raise NotImplementedError

    def tokens_ahead(
        self,
        queued_by_tenant: Mapping[str, int],
        tenant_id: str,
        prompt_tokens: int = 0,
        weight: float = 1.0,
        horizon_s: float = 0.0,
    ) -> int:
        """Prefill tokens that would be served before a new request of ``tenant_id`` (whose own prompt has
        ``prompt_tokens`` and whose share weight is ``weight``) gets its first token, if it waits
        ``horizon_s`` seconds: requests arriving meanwhile count where the order serves them first."""
        return sum(queued_by_tenant.values())

    def share_ratio(self, tenant_id: str, weight: float = 1.0) -> float:
        """How far the tenant's recent service exceeds its weighted share of it (1.0: at its share or
        no notion of shares; 2.0: twice its share). Admission sheds a tenant over its share sooner."""
        return 1.0

    def on_arrival(self, seq: Sequence) -> None:
        """A request joined the waiting queue (not called again after a preemption)."""

    def on_tokens(
        self, seq: Sequence, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> None:
        """The sequence was served tokens: computed prompt tokens, output tokens, and prompt tokens found in
        the prefix cache. Recomputed prefill after a preemption is never reported."""

    def on_finish(self, seq: Sequence) -> None:
        """The sequence left the engine (finished, aborted or failed)."""


def _fcfs_key(seq: Sequence) -> tuple[int, float]:
    return (-seq.priority, seq.arrival_time)


class FCFSPolicy(Policy):
    """First come, first served; a higher ``priority`` goes first. The latest arrival is preempted first."""

    name = "fcfs"

    def pick_next(self, waiting: Seq[Sequence], planned: Mapping[str, int] | None = None) -> Sequence:
        return min(waiting, key=_fcfs_key)

    def pick_victim(self, candidates: Seq[Sequence]) -> Sequence:
        return max(candidates, key=_fcfs_key)


class FairSharePolicy(Policy):
    """Weighted fair share in cost units: a virtual token counter (VTC) per tenant.

    Each tenant's counter is the cost it has been served (``engine.cost`` weights: computed prompt tokens,
    cached prompt tokens, output tokens) divided by its weight. The next request admitted is the oldest
    (highest priority first) of the waiting tenant with the smallest counter. A tenant with no request in
    the engine that sends one is lifted to the smallest counter among the tenants with requests in the
    engine (the last served counter when there are none): idling banks no credit. The victim of a
    preemption is the latest request of the running tenant with the largest counter. Counters of idle
    tenants are forgotten beyond ``max_idle_tenants`` (least recently active first); the lift makes that
    safe.

    Because of the lift the counters say nothing about who used the engine lately, so the policy also keeps
    each tenant's recent service (cost, decaying by half every ``SHARE_HALF_LIFE_S``) for ``share_ratio``.
    """

    name = "fair"

    def __init__(
        self,
        cost: CostWeights = DEFAULT_WEIGHTS,
        max_idle_tenants: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cost = cost
        self.max_idle_tenants = max_idle_tenants
        self.clock = clock
        self._recent: dict[str, tuple[float, float]] = {}  # tenant -> (decayed cost served, as of when)
        self._arrived: dict[str, tuple[float, float]] = {}  # tenant -> (decayed prompt tokens sent, when)
        self.counters: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self._active: Counter[str] = Counter()  # requests in the engine per tenant
        self._idle: OrderedDict[str, None] = OrderedDict()  # tenants with a counter and no request
        self._last_served = 0.0

    def pick_next(self, waiting: Seq[Sequence], planned: Mapping[str, int] | None = None) -> Sequence:
        planned = planned or {}

        oldest: dict[str, Sequence] = {}  # each tenant's first request in FCFS order
        for seq in waiting:
            first = oldest.get(seq.tenant_id)
            if first is None or _fcfs_key(seq) < _fcfs_key(first):
                oldest[seq.tenant_id] = seq

        def order(t: str) -> tuple[float, tuple[int, float]]:  # counters tie after a lift: older goes first
            pending = self.cost.prefill * planned.get(t, 0) / self.weights.get(t, 1.0)
            return (self.counters.get(t, 0.0) + pending, _fcfs_key(oldest[t]))

        return oldest[min(oldest, key=order)]

    def pick_victim(self, candidates: Seq[Sequence]) -> Sequence:
        tenant = max({s.tenant_id for s in candidates}, key=lambda t: (self.counters.get(t, 0.0), t))
        return max((s for s in candidates if s.tenant_id == tenant), key=_fcfs_key)

    def tokens_ahead(
        self,
        queued_by_tenant: Mapping[str, int],
        tenant_id: str,
        prompt_tokens: int = 0,
        weight: float = 1.0,
        horizon_s: float = 0.0,
    ) -> int:
        """The tenant's own queued prefill, and of every other tenant's only what the fair order serves
        while the tenant's counter rises through its own queue and this prompt: another tenant gets service
        until its counter reaches that level (prefill charged at the prefill weight, decodes ignored). That
        includes what another tenant with requests in the engine will send within ``horizon_s``, at its
        recent arrival rate: under overload a request admitted early otherwise waits behind later arrivals
        of tenants below it. An idle engine has nothing ahead."""
        own = queued_by_tenant.get(tenant_id, 0)
        weight = self.weights.get(tenant_id, weight) if self._active[tenant_id] else weight
        level = self._counter_on_arrival(tenant_id) + self.cost.prefill * (own + prompt_tokens) / weight
        rates = self._arrival_rates() if horizon_s > 0 else {}
        arriving = {t: int(rate * horizon_s) for t, rate in rates.items() if self._active[t]}  # backlogged
        ahead = own
        for tenant in (set(queued_by_tenant) | set(arriving)) - {tenant_id}:
            tokens = queued_by_tenant.get(tenant, 0) + arriving.get(tenant, 0)
            room = (level - self._counter_on_arrival(tenant)) * self.weights.get(tenant, 1.0)
            ahead += math.ceil(min(tokens, max(0.0, room / self.cost.prefill)))
        return ahead

    def share_ratio(self, tenant_id: str, weight: float = 1.0) -> float:
        """The tenant's share of the recent service over its weight's share among the tenants that sent
        or were served within ``SHARE_WINDOW_S`` (itself included). Safe to call from another thread."""
        now = self.clock()
        recent = dict(self._recent)  # one atomic copy: the engine thread may be adding to it
        served = {t: _decayed(value, at, now, SHARE_HALF_LIFE_S) for t, (value, at) in recent.items()}
        total = sum(served.values())
        if total <= 0:
            return 0.0
        sharing = {t for t, (_, at) in recent.items() if now - at <= SHARE_WINDOW_S} - {tenant_id}
        weights = dict(self.weights)
        fair = weight / (weight + sum(weights.get(t, 1.0) for t in sharing))
        return served.get(tenant_id, 0.0) / total / fair

    def on_arrival(self, seq: Sequence) -> None:
        tenant = seq.tenant_id
        self._serve(tenant, 0.0)
        _add_decayed(self._arrived, tenant, seq.num_prompt_tokens, self.clock(), ARRIVAL_HALF_LIFE_S)
        self.weights[tenant] = seq.weight
        if not self._active[tenant]:
            self.counters[tenant] = self._counter_on_arrival(tenant)
            self._idle.pop(tenant, None)
        self._active[tenant] += 1

    def on_tokens(
        self, seq: Sequence, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> None:
        cost = (
            self.cost.prefill * prompt_tokens
            + self.cost.cached * cached_tokens
            + self.cost.decode * output_tokens
        )
        tenant = seq.tenant_id
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weights.get(tenant, seq.weight)
        self._last_served = self.counters[tenant]
        self._serve(tenant, cost)

    def on_finish(self, seq: Sequence) -> None:
        tenant = seq.tenant_id
        self._active[tenant] -= 1
        if self._active[tenant] > 0:
            return
        del self._active[tenant]
        self._idle[tenant] = None
        while len(self._idle) > self.max_idle_tenants:
            forgotten, _ = self._idle.popitem(last=False)
            self.counters.pop(forgotten, None)
            self.weights.pop(forgotten, None)
            self._recent.pop(forgotten, None)
            self._arrived.pop(forgotten, None)

    def _serve(self, tenant: str, cost: float) -> None:
        """Add ``cost`` to the tenant's recent service, and mark it as seen now."""
        _add_decayed(self._recent, tenant, cost, self.clock(), SHARE_HALF_LIFE_S)

    def _arrival_rates(self) -> dict[str, float]:
        """Each tenant's recent prompt tokens sent per second (an exponentially weighted rate)."""
        now = self.clock()
        arrived = dict(self._arrived)  # one atomic copy: the engine thread may be adding to it
        per_s = math.log(2) / ARRIVAL_HALF_LIFE_S  # a steady rate r decays to a sum of r / per_s
        return {t: _decayed(v, at, now, ARRIVAL_HALF_LIFE_S) * per_s for t, (v, at) in arrived.items()}

    def _counter_on_arrival(self, tenant: str) -> float:
        """The tenant's counter, or if it has no request in the engine, lifted to the smallest counter of
        the tenants that have (the last served counter when none has)."""
        if self._active[tenant]:
            return self.counters.get(tenant, 0.0)
        others = [self.counters.get(t, 0.0) for t in list(self._active) if t != tenant]  # list: atomic copy
        floor = min(others) if others else self._last_served
        return max(self.counters.get(tenant, 0.0), floor)


def _decayed(value: float, at: float, now: float, half_life_s: float) -> float:
    return value * 0.5 ** (max(0.0, now - at) / half_life_s)


def _add_decayed(
    store: dict[str, tuple[float, float]], tenant: str, amount: float, now: float, half_life_s: float
) -> None:
    """Add ``amount`` to the tenant's decaying sum in ``store``, as of ``now``."""
    value, at = store.get(tenant, (0.0, now))
    store[tenant] = (_decayed(value, at, now, half_life_s) + amount, now)


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFSPolicy, "fair": FairSharePolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown scheduling policy {name!r} (known: {known})") from None
