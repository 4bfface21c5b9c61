"""A running model of how long an engine step takes, for time-to-first-token estimates.

A step costs a fixed overhead plus a cost per token; both are fitted by exponentially weighted least squares
over recent steps, so the estimate follows the machine's load and holds for step sizes not seen yet.
"""

from __future__ import annotations

import math

DEFAULT_OVERHEAD_S = 0.02  # assumed until steps of two different sizes have been seen
DEFAULT_PER_TOKEN_S = 1 / 500


class StepTimeModel:
    """``seconds(tokens) = overhead + per_token * tokens``, refitted after every step."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._sums = [0.0] * 5  # weights, n, n*n, t, n*t
        self.overhead = DEFAULT_OVERHEAD_S
        self.per_token = DEFAULT_PER_TOKEN_S

    def observe(self, tokens: int, seconds: float) -> None:
        s = [x * self.decay for x in self._sums]
        for i, value in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            s[i] += value
        self._sums = s
        w, n, nn, t, nt = s
        spread = w * nn - n * n
        if spread > 1e-9 * max(w * nn, 1.0):
            per_token = (w * nt - n * t) / spread
            overhead = (t - per_token * n) / w
            if per_token > 0 and overhead >= 0:
                self.overhead, self.per_token = overhead, per_token
                return
        if n > 0:  # one size seen so far (or a degenerate fit): keep the overhead, scale the token cost
            self.per_token = max((t - self.overhead * w) / n, 1e-7)

    def time_for(self, prefill_tokens: int, decodes: int, step_budget: int) -> float:
        """Seconds to prefill ``prefill_tokens`` while ``decodes`` sequences decode alongside."""
        if prefill_tokens <= 0:
            return 0.0
        steps = math.ceil(prefill_tokens / max(1, step_budget - decodes))
        return steps * self.overhead + self.per_token * (prefill_tokens + steps * decodes)
