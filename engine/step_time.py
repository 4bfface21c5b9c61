"""How long an engine step takes, for time-to-first-token estimates.

A step's time is modelled as ``overhead + per_prefill_token * P + per_decode * D`` for a step that carries
``P`` prefill tokens and ``D`` decodes. The three costs are fitted by non-negative weighted least squares over

- a **prior**: the steps of known sizes timed at start-up (``calibrate``), which never fades, and
- **recent steps**, each weighing ``0.5 ** (age / half_life_s)``: the fit follows the machine's load during a
  burst, and once the engine is idle the old steps fade and the prior (an idle engine's costs) is back.

Prefill cost and decode cost are separate terms, so a run of decode-only steps moves the overhead and the
per-decode cost but cannot be extrapolated into a cost per prompt token. An estimate is **reliable** only when
the data behind the prefill term spans at least two prefill sizes: a calibration, or recent steps that did.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations

HALF_LIFE_S = 10.0  # a recent step's weight halves every this many seconds
PRIOR_WEIGHT = 4.0  # each calibration step counts as this many recent steps
MIN_PREFILL_SPREAD = 8.0  # tokens: the weighted spread of prefill sizes that makes the prefill term reliable
MIN_RELIABLE_WEIGHT = 2.0  # recent steps' total weight needed to be reliable without a calibration
# A weak guess that keeps the fit defined before anything is measured (weighs almost nothing).
DEFAULT_COSTS = (0.02, 0.002, 0.002)
_DEFAULT_WEIGHT = 1e-3

_FEATURES = 3  # 1, prefill tokens, decodes
_SUMS = _FEATURES * (_FEATURES + 1) // 2 + _FEATURES + 1  # Gram matrix (upper), X'y, y'y


@dataclass(frozen=True)
class StepSample:
    """One timed step: its prefill tokens, its decodes, and the seconds it took."""

    prefill_tokens: int
    decodes: int
    seconds: float


@dataclass(frozen=True)
class StepCosts:
    """The fitted costs of a step, and whether the prefill term rests on steps of several sizes."""

    overhead: float
    per_prefill_token: float
    per_decode: float
    reliable: bool

    def step_seconds(self, prefill_tokens: int, decodes: int) -> float:
        return self.overhead + self.per_prefill_token * prefill_tokens + self.per_decode * decodes

    def prefill_tokens_within(self, seconds: float, decodes: int) -> int:
        """The most prefill tokens a step beside ``decodes`` decodes can carry and still take ``seconds``."""
        spare = seconds - self.overhead - self.per_decode * decodes
        if spare <= 0:
            return 0
        return int(spare / self.per_prefill_token) if self.per_prefill_token > 0 else 1 << 30

    def prefill_seconds(self, prefill_tokens: int, decodes: int, step_budget: int) -> float:
        """Seconds to prefill ``prefill_tokens`` in steps of ``step_budget`` tokens beside ``decodes``."""
        if prefill_tokens <= 0:
            return 0.0
        steps = math.ceil(prefill_tokens / max(1, step_budget - decodes))
        return steps * (self.overhead + self.per_decode * decodes) + self.per_prefill_token * prefill_tokens


def _sums(samples: Iterable[StepSample], weight: float) -> list[float]:
    """Weighted sufficient statistics of ``samples`` for the least-squares fit."""
    sums = [0.0] * _SUMS
    for sample in samples:
        x = (1.0, float(sample.prefill_tokens), float(sample.decodes))
        k = 0
        for i in range(_FEATURES):
            for j in range(i, _FEATURES):
                sums[k] += weight * x[i] * x[j]
                k += 1
        for i in range(_FEATURES):
            sums[k + i] += weight * x[i] * sample.seconds
        sums[-1] += weight * sample.seconds * sample.seconds
    return sums


def _unpack(sums: list[float]) -> tuple[list[list[float]], list[float]]:
    gram = [[0.0] * _FEATURES for _ in range(_FEATURES)]
    k = 0
    for i in range(_FEATURES):
        for j in range(i, _FEATURES):
            gram[i][j] = gram[j][i] = sums[k]
            k += 1
    return gram, sums[k : k + _FEATURES]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-12 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _fit(sums: list[float]) -> tuple[float, float, float]:
    """Non-negative least squares over the three costs (every subset of terms tried; 3 terms only)."""
    gram, xty = _unpack(sums)
    best: tuple[float, list[float]] | None = None
    for size in range(_FEATURES, 0, -1):
        for subset in combinations(range(_FEATURES), size):
            theta = _solve([[gram[i][j] for j in subset] for i in subset], [xty[i] for i in subset])
            if theta is None or min(theta) < 0:
                continue
            residual = sums[-1] - sum(t * xty[i] for t, i in zip(theta, subset, strict=True))
            if best is None or residual < best[0] - 1e-15:
                full = [0.0] * _FEATURES
                for t, i in zip(theta, subset, strict=True):
                    full[i] = t
                best = (residual, full)
    if best is None:
        return DEFAULT_COSTS
    overhead, per_prefill, per_decode = best[1]
    return overhead, per_prefill, per_decode


def _default_sums() -> list[float]:
    overhead, per_token, per_decode = DEFAULT_COSTS
    shapes = ((0, 1), (0, 16), (256, 0))
    samples = [StepSample(p, d, overhead + per_token * p + per_decode * d) for p, d in shapes]
    return _sums(samples, _DEFAULT_WEIGHT)


def _prefill_spread(sums: list[float]) -> float:
    """Weighted standard deviation of the prefill sizes behind ``sums``."""
    weight, prefill, prefill_sq = sums[0], sums[1], sums[3]
    if weight <= 0:
        return 0.0
    return math.sqrt(max(0.0, prefill_sq / weight - (prefill / weight) ** 2))


class StepTimeModel:
    """Step costs from a start-up calibration refined by recent steps; safe to read from another thread."""

    def __init__(self, half_life_s: float = HALF_LIFE_S, prior_weight: float = PRIOR_WEIGHT) -> None:
        self.half_life_s = half_life_s
        self.prior_weight = prior_weight
        self._prior = _default_sums()
        self._calibrated = False
        self._recent = [0.0] * _SUMS
        self._recent_at = time.monotonic()
        self._lock = threading.Lock()

    def calibrate(self, samples: Iterable[StepSample]) -> None:
        """Make timed steps of known sizes the prior (replacing any earlier calibration)."""
        samples = list(samples)
        sums = _sums(samples, self.prior_weight)
        with self._lock:
            self._prior = [a + b for a, b in zip(_default_sums(), sums, strict=True)]
            self._calibrated = _prefill_spread(sums) >= MIN_PREFILL_SPREAD

    def observe(self, prefill_tokens: int, decodes: int, seconds: float, now: float | None = None) -> None:
        """Add a step that ran ``prefill_tokens`` prefill tokens beside ``decodes`` decodes."""
        now = time.monotonic() if now is None else now
        new = _sums([StepSample(prefill_tokens, decodes, seconds)], 1.0)
        with self._lock:
            fade = self._fade(now)
            self._recent = [fade * a + b for a, b in zip(self._recent, new, strict=True)]
            self._recent_at = now

    def costs(self, now: float | None = None) -> StepCosts:
        """The costs fitted to the prior and the recent steps, weighed as of ``now``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            fade = self._fade(now)
            recent = [fade * a for a in self._recent]
            prior, calibrated = self._prior, self._calibrated
        reliable = calibrated or (
            recent[0] >= MIN_RELIABLE_WEIGHT and _prefill_spread(recent) >= MIN_PREFILL_SPREAD
        )
        overhead, per_prefill, per_decode = _fit([a + b for a, b in zip(prior, recent, strict=True)])
        return StepCosts(overhead, per_prefill, per_decode, reliable)

    def _fade(self, now: float) -> float:
        return 0.5 ** (max(0.0, now - self._recent_at) / self.half_life_s)
