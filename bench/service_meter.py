"""Per-tenant service as the engine charges it, step by step, and the fairness figures drawn from it.

``MeteredPolicy`` wraps the engine's scheduling policy and adds up the cost of the tokens the scheduler
reports through ``on_tokens`` (computed prefill chunks, cached prompt tokens, output tokens; recomputed
prefill is never reported), per tenant, whatever the policy: FCFS is measured the same way as fair share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import combinations, pairwise

from engine.cost import DEFAULT_WEIGHTS, CostWeights, request_cost
from engine.policies import Policy
from engine.sequence import Sequence


class MeteredPolicy:
    """``inner`` with every decision and hook unchanged (attributes are looked up on it); ``served`` holds
    each tenant's cost units served so far."""

    def __init__(self, inner: Policy, weights: CostWeights = DEFAULT_WEIGHTS) -> None:
        self.inner = inner
        self.cost_weights = weights
        self.served: defaultdict[str, float] = defaultdict(float)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def on_tokens(
        self, seq: Sequence, prompt_tokens: int, output_tokens: int, cached_tokens: int = 0
    ) -> None:
        cost = request_cost(prompt_tokens, cached_tokens, output_tokens, self.cost_weights)
        self.served[seq.tenant_id] += cost
        self.inner.on_tokens(seq, prompt_tokens, output_tokens, cached_tokens)


@dataclass(frozen=True)
class StepRecord:
    """After one engine step: each tenant's cost served so far, and the tenants that had a request in the
    engine during the step (backlogged)."""

    served: dict[str, float]
    backlogged: frozenset[str]


def max_weighted_gap(records: Seq[StepRecord], weights: Mapping[str, float]) -> float:
    """The largest difference of weighted service (cost / weight) received by two tenants over any span of
    consecutive steps during which both were backlogged (the quantity the VTC bound limits).

    ``records[0]`` is the state before the first step; each later record is the state after one step.
    """
    gap = 0.0
    for a, b in combinations(sorted(weights), 2):
        low = high = None  # the range of the difference over the current span, from its start
        for before, after in pairwise(records):
            if not {a, b} <= after.backlogged:
                low = high = None
                continue
            if low is None or high is None:
                low = high = _difference(before, a, b, weights)
            now = _difference(after, a, b, weights)
            low, high = min(low, now), max(high, now)
            gap = max(gap, high - low)
    return gap


def _difference(record: StepRecord, a: str, b: str, weights: Mapping[str, float]) -> float:
    return record.served.get(a, 0.0) / weights[a] - record.served.get(b, 0.0) / weights[b]


def contended_service(records: Seq[StepRecord], tenants: frozenset[str]) -> dict[str, float]:
    """Each tenant's cost served during the steps in which every one of ``tenants`` was backlogged."""
    served = dict.fromkeys(sorted(tenants), 0.0)
    for before, after in pairwise(records):
        if tenants <= after.backlogged:
            for tenant in tenants:
                served[tenant] += after.served.get(tenant, 0.0) - before.served.get(tenant, 0.0)
    return served
