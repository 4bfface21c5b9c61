"""Scheduling policies: which waiting request goes next, which running one is preempted.

The scheduler asks the policy these two questions and tells it what happened (arrivals, tokens served,
finishes) through the hooks, so a weighted fair-share policy keeping per-tenant virtual cost counters fits
without touching the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

from engine.sequence import Sequence


class Policy:
    """The scheduler's source of ordering decisions; subclasses answer the two questions."""

    name: str

    def pick_next(self, waiting: Seq[Sequence]) -> Sequence:
        """The waiting sequence to admit next (``waiting`` is never empty)."""
        raise NotImplementedError

    def pick_victim(self, candidates: Seq[Sequence]) -> Sequence:
        """The running sequence to preempt when KV blocks run out (``candidates`` is never empty)."""
        raise NotImplementedError

    def tokens_ahead(self, queued_by_tenant: Mapping[str, int], tenant_id: str) -> int:
        """Prefill tokens that would be served before a new request of ``tenant_id``."""
        return sum(queued_by_tenant.values())

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

    def pick_next(self, waiting: Seq[Sequence]) -> Sequence:
        return min(waiting, key=_fcfs_key)

    def pick_victim(self, candidates: Seq[Sequence]) -> Sequence:
        return max(candidates, key=_fcfs_key)


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown scheduling policy {name!r} (known: {known})") from None
