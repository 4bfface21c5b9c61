"""Public value types of the engine: what callers pass in and get back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output tokens."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # same seed -> same tokens, whatever else is in the batch
    stop: tuple[str, ...] = ()  # stop strings; never emitted
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be non-negative (0: no cut), got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop token ids must be non-negative")


@dataclass
class RequestOutput:
    """One delta of a request's stream; the last one has ``finished`` set.

    Counts are cumulative; ``text``/``token_ids``/``token_times`` are what is new since the previous delta
    (several engine steps' worth when the consumer was slow: deltas merge, the engine never waits).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # time.monotonic() of each new token
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "deadline"
    prompt_tokens: int = 0  # prompt tokens that ran (computed or cached): 0 for one that ended unstarted
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    output_tokens: int = 0
    arrival_time: float = 0.0  # time.monotonic() when the engine received the request
    queue_time: float | None = None  # seconds from arrival to first scheduled
    first_token_time: float | None = None  # time.monotonic() of the first output token
    error: str | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one (new parts appended, latest state kept)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.token_times.extend(later.token_times)
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.prompt_tokens = later.prompt_tokens
        self.cached_tokens = later.cached_tokens
        self.output_tokens = later.output_tokens
        self.arrival_time = later.arrival_time
        self.queue_time = later.queue_time
        self.first_token_time = later.first_token_time
        self.error = later.error


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's live state (also read by the dashboard)."""

    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int  # empty blocks and cached blocks no sequence holds (reused when needed)
    block_size: int
    tokens_per_s: float  # output tokens per second over the recent window
    prompt_tokens_per_s: float
    steps: int
    preemptions: int
    # actual / predicted time to first token over recent requests (None until a request has started; the
    # 95th percentile until ``engine.core.RATIO_TAIL_MIN`` have)
    ttft_estimate_ratio_p50: float | None = None
    ttft_estimate_ratio_p95: float | None = None
    kv_blocks_cached: int = 0  # blocks findable by prefix hash, held or free
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)  # waiting requests per tenant id
    step_seconds: float = 0.0  # time spent in steps since start (over ``steps``: the mean step time)


@dataclass(frozen=True)
class TTFTEstimate:
    """A new request's predicted time to first token and what it rests on."""

    seconds: float
    queued_tokens: int  # prefill tokens that would be computed before this request's own
    reliable: bool  # False while the step-time model has not seen prefill steps of several sizes
    share_ratio: float = 1.0  # the tenant's recent service over its fair share (the policy's ``share_ratio``)
    # a high quantile (``TTFT_RATIO_TAIL``) of the tenant's own recent actual / predicted TTFT, once it
    # has enough finished requests: under fair share a tenant above its share waits behind others' later
    # arrivals, which no estimate foresees
    tenant_ratio_tail: float | None = None
