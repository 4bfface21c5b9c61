"""The capacity plan: how many engine replicas a request mix needs, from a measured step-time profile.

A **profile** (``weir bench profile``) holds the seconds of engine steps measured on a grid of prefill
tokens x decodes (the decodes at a reference context), the extra seconds per context token a decode attends
to, the engine's limits and the model's load time. ``StepProfile.step_seconds`` reads a step's time from the
grid, made monotone (a step never takes less than a smaller one: a busy machine's noise is no speed-up):
bilinear interpolation in (prefill tokens, decodes), linear beyond the grid's edges, plus the context term.

A replica's **capacity** is the highest Poisson arrival rate at which the simulated continuous-batching
schedule keeps TTFT p99 and TPOT p99 within their targets. ``simulate`` replays the engine's step planning
(``engine/scheduler.py``) request by request: running decodes first, then prefill chunks of at most
``prefill_chunk_size`` tokens in arrival order within the step's token budget and the running-sequence cap,
the prefill beside decodes capped so the step fits the scheduler's share of the TPOT target
(``TPOT_HEADROOM``), each step lasting what the profile says.
KV memory is not modelled (no preemption); ``Simulation.peak_kv_tokens`` says how much the schedule held.

**Host work.** The grid times the engine alone, on every core. A serving process also spends CPU outside the
engine on each request (HTTP, auth, tokenizing, the quota reservation, settlement) and on each output
token (its SSE event); ``HostCost`` holds those CPU seconds, measured on a real `weir serve`. At ``rate``
requests per second the host keeps ``rate * (request_s + token_s * mean output)`` cores busy, which the
engine's threads lose: every step is stretched by ``cores / (cores - busy)``, and no rate that would keep
every core busy with host work alone is served.

The **plan** for an offered rate: ``ceil(rate / capacity)`` replicas, plus one per failure to survive
(N+1): a failed replica's replacement serves only after the model's load time, so the survivors must carry
the whole rate meanwhile; without the spare, the rate above the survivors' capacity during that load is
refused or served late. The spare replicas are the warm capacity that protection costs.

Pure Python: no torch, HTTP or SQL, so the API's gateway and the benchmarks can both use it.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from engine.scheduler import MIN_PREFILL_TOKENS, TPOT_HEADROOM

PROFILE_KIND = "weir.step_profile"
PROFILE_VERSION = 1
QUANTILE = 0.99
SIM_REQUESTS = 600  # requests simulated per rate
WARMUP_SHARE = (
    0.05  # the first requests of a simulation, left out of the percentiles (the engine starts idle)
)
RATE_PRECISION = 0.01  # the capacity search stops within this relative step


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points, extended linearly beyond the first and last."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``, not below zero (0 for fewer than two distinct xs)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var)


@dataclass(frozen=True)
class EngineLimits:
    """The step-planning limits the profile was measured with (``EngineConfig``'s)."""

    max_batched_tokens: int
    max_num_seqs: int
    prefill_chunk_size: int
    kv_tokens: int  # tokens the KV pool holds


@dataclass(frozen=True)
class HostCost:
    """CPU seconds a serving process spends outside the engine, per request and per output token, on a
    machine of ``cores`` cores that the engine's threads share."""

    cores: int
    request_s: float
    token_s: float

    @classmethod
    def from_json(cls, data: dict) -> HostCost:
        return cls(int(data["cores"]), float(data["request_s"]), float(data["token_s"]))

    def plus(self, other: HostCost) -> HostCost:
        """Both processes' host work on the same cores (a load generator beside the server)."""
        return HostCost(self.cores, self.request_s + other.request_s, self.token_s + other.token_s)

    def per_request(self, output_tokens: float) -> float:
        """CPU seconds of one request of ``output_tokens`` output tokens."""
        return self.request_s + self.token_s * output_tokens

    def busy_cores(self, rate: float, output_tokens: float) -> float:
        return rate * self.per_request(output_tokens)

    def stretch(self, rate: float, output_tokens: float) -> float:
        """How much longer engine steps take beside the host work of ``rate`` requests per second
        (infinite once that work alone needs every core)."""
        spare = self.cores - self.busy_cores(rate, output_tokens)
        return self.cores / spare if spare > 0 else math.inf

    def max_rate(self, output_tokens: float) -> float:
        """The rate whose host work alone keeps every core busy."""
        per_request = self.per_request(output_tokens)
        return self.cores / per_request if per_request > 0 else math.inf


@dataclass(frozen=True)
class StepProfile:
    """Measured step times of one model on one machine, and how long the model takes to load."""

    prefill_tokens: tuple[int, ...]  # the grid's rows, ascending, starting at 0
    decodes: tuple[int, ...]  # its columns, ascending, starting at 0
    seconds: tuple[tuple[float, ...], ...]  # [row][column]; the (0, 0) cell is extrapolated, not measured
    context: int  # tokens of context each decode of the grid attends to
    per_context_token: float  # extra seconds per context token of a decode beyond ``context``
    limits: EngineLimits
    load_s: float
    host: HostCost | None = None  # the serving process's own work, when the profile measured it
    _columns: dict[int, tuple[float, ...]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_json(cls, data: dict) -> StepProfile:
        """The profile of ``weir bench profile``'s JSON; ValueError when it is not one."""
        if data.get("kind") != PROFILE_KIND or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"not a step profile of version {PROFILE_VERSION} ({PROFILE_KIND})")
        try:
            grid, ctx, engine = data["steps"], data["context"], data["engine"]
            rows, columns = tuple(grid["prefill_tokens"]), tuple(grid["decodes"])
            measured = [[None if s is None else float(s) for s in row] for row in grid["seconds"]]
            limits = EngineLimits(
                int(engine["max_batched_tokens"]),
                int(engine["max_num_seqs"]),
                int(engine["prefill_chunk_size"]),
                int(engine["kv_tokens"]),
            )
            sweep = (int(ctx["decodes"]), ctx["contexts"], ctx["seconds"])
            load_s = float(data["load_s"])
            host = HostCost.from_json(data["host"]["server"]) if data.get("host") else None
        except (KeyError, TypeError) as exc:
            raise ValueError(f"the step profile lacks {exc}") from None
        profile = cls.from_grid(rows, columns, measured, int(grid["context"]), sweep, limits, load_s)
        return replace(profile, host=host)

    @classmethod
    def from_grid(
        cls,
        prefill_tokens: Sequence[int],
        decodes: Sequence[int],
        seconds: Sequence[Sequence[float | None]],
        context: int,
        sweep: tuple[int, Sequence[int], Sequence[float]],
        limits: EngineLimits,
        load_s: float,
    ) -> StepProfile:
        """A profile from a measured grid (the empty step, ``(0, 0)``, may be None) and ``sweep``: a batch
        of decodes, the contexts each of them attended to, and the seconds of each such step; ValueError
        when the grid is incomplete."""
        sweep_decodes, contexts, context_seconds = sweep
        rows, columns = tuple(prefill_tokens), tuple(decodes)
        if rows[:1] != (0,) or columns[:1] != (0,) or len(rows) < 2 or len(columns) < 2:
            raise ValueError("the grid needs prefill tokens and decodes that start at 0 and go beyond it")
        if list(rows) != sorted(set(rows)) or list(columns) != sorted(set(columns)):
            raise ValueError("the grid's prefill tokens and decodes must be ascending")
        if len(seconds) != len(rows) or any(len(row) != len(columns) for row in seconds):
            raise ValueError("the grid's seconds must have a row per prefill size and a column per decodes")
        if any(s is None or s <= 0 for i, row in enumerate(seconds) for j, s in enumerate(row) if i or j):
            raise ValueError("every step of the grid but the empty one needs a measured time")
        if len(contexts) != len(context_seconds) or not contexts or sweep_decodes < 1:
            raise ValueError("the context sweep needs decodes and a time per context")
        if load_s < 0:
            raise ValueError("the load time must not be negative")
        table = [list(row) for row in seconds]
        for i in range(len(rows)):  # a step never takes less than a smaller one: noise is not a speed-up
            for j in range(len(columns)):
                smaller = [table[a][b] for a, b in ((i - 1, j), (i, j - 1)) if min(a, b) >= 0 and (a or b)]
                if i or j:
                    table[i][j] = max([table[i][j], *smaller])
        # The empty step: the fixed cost per step, extended from the smallest steps on both axes.
        along_prefill = _interpolate(rows[1:3], [table[i][0] for i in (1, 2)], 0) if len(rows) > 2 else None
        along_decodes = (
            _interpolate(columns[1:3], [table[0][j] for j in (1, 2)], 0) if len(columns) > 2 else None
        )
        guesses = [g for g in (along_prefill, along_decodes) if g is not None]
        smallest = min(table[1][0], table[0][1])
        table[0][0] = min(smallest, max(0.0, sum(guesses) / len(guesses))) if guesses else smallest
        return cls(
            rows,
            columns,
            tuple(tuple(float(s) for s in row) for row in table),
            context,
            _slope([float(c) for c in contexts], [float(s) for s in context_seconds]) / sweep_decodes,
            limits,
            load_s,
        )

    def step_seconds(self, prefill_tokens: int, decodes: int, context_tokens: int | None = None) -> float:
        """Seconds of a step of ``prefill_tokens`` prefill tokens beside ``decodes`` decodes whose contexts
        sum to ``context_tokens`` (default: the grid's context each)."""
        if prefill_tokens <= 0 and decodes <= 0:
            return 0.0
        seconds = _interpolate(self.prefill_tokens, self._column(decodes), prefill_tokens)
        if context_tokens is not None:
            seconds += self.per_context_token * (context_tokens - decodes * self.context)
        return max(seconds, 1e-6)

    def prefill_within(self, seconds: float, decodes: int, context_tokens: int, most: int) -> int:
        """The most prefill tokens (up to ``most``) a step beside ``decodes`` decodes can carry within
        ``seconds``: the engine's cap beside decodes with a TPOT target."""
        spare = seconds - self.per_context_token * (context_tokens - decodes * self.context)
        column, rows = self._column(decodes), self.prefill_tokens
        if column[0] > spare:
            return 0
        # the segment where the step's time passes ``spare`` (the last one, extended, when none does)
        i = next((k for k in range(1, len(rows)) if column[k] > spare), len(rows) - 1)
        rise = column[i] - column[i - 1]
        if rise <= 0:
            return most
        tokens = rows[i - 1] + (spare - column[i - 1]) * (rows[i] - rows[i - 1]) / rise
        return max(0, min(most, int(tokens)))

    def _column(self, decodes: int) -> tuple[float, ...]:
        """The step times at each of the grid's prefill sizes beside ``decodes`` decodes (memoized)."""
        column = self._columns.get(decodes)
        if column is None:
            column = tuple(_interpolate(self.decodes, row, decodes) for row in self.seconds)
            self._columns[decodes] = column
        return column


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: each of ``values`` equally likely, or uniform over ``low..high``."""

    low: int
    high: int
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """``N`` (always N), ``LOW-HIGH`` (uniform, inclusive) or ``A,B,C`` (each equally likely)."""
        try:
            if "," in text:
                values = tuple(int(v) for v in text.split(","))
                lengths = cls(min(values), max(values), values)
            elif "-" in text:
                low, high = (int(v) for v in text.split("-", 1))
                lengths = cls(low, high)
            else:
                lengths = cls(int(text), int(text))
        except ValueError:
            raise ValueError(f"a length is N, LOW-HIGH or A,B,C (positive integers), got {text!r}") from None
        if not 1 <= lengths.low <= lengths.high:
            raise ValueError(f"lengths must be positive with LOW <= HIGH, got {text!r}")
        return lengths

    def draw(self, rng: random.Random) -> int:
        return rng.choice(self.values) if self.values else rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values) if self.values else (self.low + self.high) / 2

    def __str__(self) -> str:
        if self.values:
            return ",".join(map(str, self.values))
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True)
class Mix:
    """The requests' prompt and output lengths (in tokens)."""

    prompt: Lengths
    output: Lengths


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    tpot_s: float
    quantile: float = QUANTILE


@dataclass(frozen=True)
class Simulation:
    """What a simulated replica gave the requests at one rate."""

    rate: float
    ttft_p: float  # seconds, at the targets' quantile
    tpot_p: float
    peak_kv_tokens: int
    served_rps: float = 0.0  # requests finished per second, from the first arrival to the last finish

    def meets(self, targets: Targets) -> bool:
        return self.ttft_p <= targets.ttft_s and self.tpot_p <= targets.tpot_s


class _Request:
    __slots__ = ("arrival", "prompt", "output", "computed", "produced", "first", "last")

    def __init__(self, arrival: float, prompt: int, output: int) -> None:
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.computed = 0  # prompt tokens prefilled
        self.produced = 0  # output tokens sampled
        self.first = self.last = 0.0


def _quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _arrivals(mix: Mix, rate: float, requests: int, seed: int) -> list[_Request]:
    """Poisson arrivals at ``rate`` with lengths from ``mix``: the same seed gives the same pattern, scaled,
    at every rate."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(1.0)
        arrivals.append(_Request(at / rate, mix.prompt.draw(rng), mix.output.draw(rng)))
    return arrivals


def simulate(
    profile: StepProfile,
    mix: Mix,
    rate: float,
    targets: Targets,
    requests: int = SIM_REQUESTS,
    seed: int = 0,
) -> Simulation:
    """Replay one replica's step schedule for ``requests`` Poisson arrivals at ``rate`` per second."""
    if rate <= 0:
        raise ValueError("the rate must be positive")
    pending = _arrivals(mix, rate, requests, seed)
    limits = profile.limits
    stretch = profile.host.stretch(rate, mix.output.mean) if profile.host else 1.0
    if math.isinf(stretch):
        return Simulation(rate, math.inf, math.inf, 0)
    waiting: deque[_Request] = deque()
    prefilling: list[_Request] = []  # admitted, prompt not fully computed; in arrival order
    decoding: list[_Request] = []
    now, kv, peak_kv, decode_context, next_arrival, finished = 0.0, 0, 0, 0, 0, 0
    while finished < requests:
        while next_arrival < requests and pending[next_arrival].arrival <= now:
            waiting.append(pending[next_arrival])
            next_arrival += 1
        if not (prefilling or decoding or waiting):
            now = pending[next_arrival].arrival
            continue
        decodes = decoding[: limits.max_batched_tokens]
        context = (
            decode_context if len(decodes) == len(decoding) else sum(r.prompt + r.produced for r in decodes)
        )
        budget = limits.max_batched_tokens - len(decodes)
        if decodes:
            fits = profile.prefill_within(
                TPOT_HEADROOM * targets.tpot_s / stretch, len(decodes), context, budget
            )
            budget = min(budget, max(MIN_PREFILL_TOKENS, fits))
        chunks: list[tuple[_Request, int]] = []
        for r in prefilling:
            if budget <= 0:
                break
            n = min(r.prompt - r.computed, limits.prefill_chunk_size, budget)
            chunks.append((r, n))
            budget -= n
        while budget > 0 and waiting and len(prefilling) + len(decoding) < limits.max_num_seqs:
            r = waiting.popleft()
            prefilling.append(r)
            n = min(r.prompt, limits.prefill_chunk_size, budget)
            chunks.append((r, n))
            budget -= n
        prefill = sum(n for _, n in chunks)
        now += stretch * profile.step_seconds(prefill, len(decodes), context)
        kv += prefill + len(decodes)  # the KV of every computed token; a sampled token's once it decodes
        peak_kv = max(peak_kv, kv)
        sampled = list(decodes)
        decode_context += len(decodes)
        for r, n in chunks:
            r.computed += n
            if r.computed == r.prompt:
                prefilling.remove(r)
                decoding.append(r)
                decode_context += r.prompt + 1  # with its first token, sampled below
                sampled.append(r)
        for r in sampled:
            r.produced += 1
            if r.produced == 1:
                r.first = now
            r.last = now
            if r.produced >= r.output:
                decoding.remove(r)
                decode_context -= r.prompt + r.produced
                kv -= r.prompt + r.produced - 1
                finished += 1
    counted = pending[int(requests * WARMUP_SHARE) :]
    ttfts = [r.first - r.arrival for r in counted]
    tpots = [(r.last - r.first) / (r.produced - 1) for r in counted if r.produced > 1]
    q = targets.quantile
    served = requests / max(now - pending[0].arrival, 1e-9)
    return Simulation(rate, _quantile(ttfts, q), _quantile(tpots, q), peak_kv, served)


def capacity(
    profile: StepProfile, mix: Mix, targets: Targets, requests: int = SIM_REQUESTS, seed: int = 0
) -> Simulation:
    """The highest rate whose simulation meets the targets (found by doubling, then bisection), with its
    figures; a rate of 0 when not even a lone request meets them. It is never above the rate a replica
    serves when every request arrives at once: beyond it the queue grows without bound, however loose the
    targets (which a finite simulation would not show). With host work, that rate ``r`` is the engine's
    alone, ``r0``, slowed by the host work of ``r`` itself: ``r = r0 / (1 + r0 / host.max_rate)``."""
    alone = simulate(profile, mix, 1e-6, targets, requests=min(requests, 50), seed=seed)
    if not alone.meets(targets):
        return Simulation(0.0, alone.ttft_p, alone.tpot_p, alone.peak_kv_tokens)
    ceiling = simulate(replace(profile, host=None), mix, 1e12, targets, requests, seed).served_rps
    if profile.host:
        ceiling /= 1 + ceiling / profile.host.max_rate(mix.output.mean)
    service = profile.step_seconds(int(mix.prompt.mean), 0) + mix.output.mean * profile.step_seconds(0, 1)
    low, high = None, min(1.0 / service, ceiling)
    while True:
        trial = simulate(profile, mix, high, targets, requests, seed)
        if not trial.meets(targets):
            break
        if high >= ceiling:
            return trial
        low, high = trial, min(high * 2, ceiling)
    if low is None:  # the first guess failed: halve until one meets
        while True:
            high /= 2
            trial = simulate(profile, mix, high, targets, requests, seed)
            if trial.meets(targets):
                low, high = trial, high * 2
                break
    while (high - low.rate) / high > RATE_PRECISION:
        trial = simulate(profile, mix, (low.rate + high) / 2, targets, requests, seed)
        if trial.meets(targets):
            low = trial
        else:
            high = trial.rate
    return low


@dataclass(frozen=True)
class Plan:
    """Replicas for an offered rate, with and without spares for failures."""

    rate: float
    replica: Simulation  # one replica at its capacity
    failures: int
    load_s: float

    kv_tokens: int  # the KV pool of a replica, to compare with the simulation's peak

    @property
    def capacity(self) -> float:
        return self.replica.rate

    @property
    def replicas(self) -> int:
        """Replicas that carry the rate within the targets, none failed."""
        return max(1, math.ceil(self.rate / self.capacity - 1e-9))

    @property
    def replicas_with_spares(self) -> int:
        """Replicas that still carry the rate with ``failures`` of them down while replacements load."""
        return self.replicas + self.failures

    @property
    def spare_rps(self) -> float:
        """The warm capacity the spares add: idle unless replicas fail."""
        return self.failures * self.capacity

    def utilization(self, replicas: int) -> float:
        return self.rate / (replicas * self.capacity)

    @property
    def excess_without_spares_rps(self) -> float:
        """Arrivals per second beyond what the survivors carry while a failed replica's replacement loads,
        with no spare."""
        return max(0.0, self.rate - max(0, self.replicas - self.failures) * self.capacity)

    @property
    def excess_requests(self) -> float:
        """Requests refused or late during one replacement's load, with no spare."""
        return self.excess_without_spares_rps * self.load_s


def make_plan(
    profile: StepProfile,
    mix: Mix,
    targets: Targets,
    rate: float,
    failures: int = 1,
    requests: int = SIM_REQUESTS,
) -> Plan:
    """The plan for ``rate`` requests per second of ``mix`` within ``targets``, surviving ``failures``."""
    if rate <= 0 or failures < 0:
        raise ValueError("the rate must be positive and the failures not negative")
    replica = capacity(profile, mix, targets, requests)
    if replica.rate <= 0:
        raise ValueError(
            f"a lone request misses the targets on this profile (TTFT p99 {replica.ttft_p * 1e3:.0f} ms, "
            f"TPOT p99 {replica.tpot_p * 1e3:.0f} ms): no number of replicas meets them"
        )
    return Plan(rate, replica, failures, profile.load_s, profile.limits.kv_tokens)
