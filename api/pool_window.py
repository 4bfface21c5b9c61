"""How much work the gateway lets one backend hold: a window of outstanding cost units, adapted from the
latencies the backend is observed to deliver.

A request's outstanding cost is what it still has to run: its prompt until its first token (prefill weight,
uncached), plus the decode weight for every output token it may still produce. A backend has room while its
outstanding cost plus the new request's stays within the window; a backend with nothing outstanding always
has room, so one request runs whatever the window. The window grows additively (by about one request per
round of requests) while first tokens arrive within half the tenant's TTFT target and tokens within its
TPOT target, and shrinks by a quarter when one does not, at most once per observed TTFT, so a backend's
own queue stays short and the wait happens in the gateway, where the fair order and shedding apply. Half
the TTFT target: the other half is left for the wait in the gateway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SHRINK = 0.75
TTFT_SHARE = 0.5  # of the tenant's TTFT target, the part a backend's own queue and prefill may take
EWMA = 0.2  # weight of a new TTFT observation in the running mean


@dataclass
class Window:
    """One backend's window and its latency observations."""

    size: float
    maximum: float
    floor: float = 1.0
    ttft_s: float | None = None  # running mean of the time from dispatch to first token
    _calm_until: float = field(default=0.0, repr=False)

    def has_room(self, outstanding: float, cost: float) -> bool:
        return outstanding <= 0 or outstanding + cost <= self.size

    def observe_first_token(self, ttft_s: float, target_s: float | None, cost: float) -> None:
        """A request dispatched ``ttft_s`` ago got its first token; its tenant's TTFT target is
        ``target_s`` and its cost ``cost``."""
        self.ttft_s = ttft_s if self.ttft_s is None else (1 - EWMA) * self.ttft_s + EWMA * ttft_s
        if target_s is not None and ttft_s > TTFT_SHARE * target_s:
            self._shrink(ttft_s)
        else:
            self._grow(cost)

    def observe_tpot(self, tpot_s: float, target_s: float | None) -> None:
        """A request finished with a mean time per output token of ``tpot_s`` against ``target_s``."""
        if target_s is not None and tpot_s > target_s:
            self._shrink(self.ttft_s or 0.0)

    def _grow(self, cost: float) -> None:
        self.size = min(self.maximum, self.size + cost * min(1.0, cost / self.size))

    def _shrink(self, calm_s: float) -> None:
        now = time.monotonic()
        if now < self._calm_until:  # one cut per round: the requests already sent saw the old window
            return
        self.size = max(self.floor, self.size * SHRINK)
        self._calm_until = now + calm_s
