"""The fair-share benchmark's workloads, after the VTC paper (OSDI'24), scaled to a small CPU.

Each tenant keeps ``depth`` requests in the engine: when one ends, the tenant sends the next, so it is
backlogged for the whole run (its sending rate is whatever it is served). An on/off tenant instead stays
idle until ``start`` (a fraction of the run) and then sends ``burst`` requests at once, and nothing more.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.workload import BenchRequest


@dataclass(frozen=True)
class TenantLoad:
    """One tenant of a workload: its weight, how many requests it keeps in the engine, their shape."""

    name: str
    weight: float = 1.0
    depth: int = 8  # requests kept in the engine (topped up as they end)
    prompt_len: tuple[int, int] = (16, 48)  # inclusive uniform ranges
    output_len: tuple[int, int] = (8, 24)
    start: float = 0.0  # fraction of the run before which the tenant sends nothing
    burst: int | None = None  # sends this many requests at ``start`` and no more (an on/off tenant)

    def max_tokens(self) -> int:
        """The longest request this tenant sends (prompt and output)."""
        return self.prompt_len[1] + self.output_len[1]

    def wants(self, in_engine: int, sent: int, progress: float) -> int:
        """How many requests the tenant sends now, with ``in_engine`` of its requests in the engine,
        ``sent`` sent so far, at ``progress`` (0..1) through the run."""
        if progress < self.start:
            return 0
        if self.burst is not None:
            return self.burst - sent
        return max(0, self.depth - in_engine)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    tenants: tuple[TenantLoad, ...]


WORKLOADS = (
    Workload(
        "rate",
        "same shape; a keeps twice as many requests queued as b (sends twice as fast), both backlogged",
        (TenantLoad("a", depth=16), TenantLoad("b", depth=8)),
    ),
    Workload(
        "shapes",
        "a: long prompts, short outputs; b: short prompts, long outputs; both backlogged",
        (
            TenantLoad("a", prompt_len=(128, 256), output_len=(2, 4)),
            TenantLoad("b", prompt_len=(8, 16), output_len=(24, 48)),
        ),
    ),
    Workload(
        "weights",
        "three tenants of weights 1:2:3, same shape, all backlogged",
        (TenantLoad("w1", weight=1.0), TenantLoad("w2", weight=2.0), TenantLoad("w3", weight=3.0)),
    ),
    Workload(
        "onoff",
        "a backlogged throughout; b idle for the first third, then a burst of 16 requests",
        (TenantLoad("a"), TenantLoad("b", start=1 / 3, burst=16)),
    ),
)


class RequestSource:
    """Seeded requests of one tenant, drawn one at a time: uniform lengths, random ordinary token ids (so
    no two prompts share a prefix cache block)."""

    def __init__(self, tenant: TenantLoad, token_ids: Sequence[int], seed: int) -> None:
        self.tenant = tenant
        self.token_ids = token_ids
        self.rng = random.Random(f"{seed}/{tenant.name}")

    def next(self) -> BenchRequest:
        prompt_len = self.rng.randint(*self.tenant.prompt_len)
        output_len = self.rng.randint(*self.tenant.output_len)
        return BenchRequest(tuple(self.rng.choice(self.token_ids) for _ in range(prompt_len)), output_len)
