"""What one admitted request is (``Job``) and what it used (``Tracker``): the numbers it is settled and
billed with. Billing counts the tokens the tenant asked for and got; recomputed prefill is never here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from api.errors import APIError
from api.openai_format import ResponseShape, usage_dict
from engine.cost import CostWeights, request_cost
from engine.types import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from api.output_allowance import OutputAllowance
    from api.runtime import Runtime


@dataclass
class Job:
    """One request that passed auth, validation, reservation and admission."""

    runtime: Runtime
    request_id: str
    tenant_id: int
    tenant_name: str
    key_id: int | None
    prompt_ids: list[int]
    params: SamplingParams
    shape: ResponseShape
    stream: bool
    reservation: Any  # the tenants package's reservation, settled exactly once
    output: OutputAllowance  # the output tokens the reservation covers
    rate_limit_headers: dict[str, str] = field(default_factory=dict)  # the tenant's allowance at admission
    tpot_target_s: float | None = None  # the tenant's time-per-output-token target
    weight: float = 1.0  # the tenant's share weight under the fair policy
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    started: float = field(default_factory=time.monotonic)


@dataclass
class Tracker:
    """Accumulates a request's engine deltas and how its client behaved."""

    job: Job
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    arrival_time: float | None = None
    queue_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: str | None = None  # the engine's: stop | length | abort | error
    engine_error: str | None = None
    disconnected: bool = False  # the client went away before its answer was complete
    dropped: bool = False  # the client stopped reading for longer than the client timeout
    responded: bool = False  # the last byte of the answer was handed to the server

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.job.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completed(self) -> bool:
        """The engine ended the request normally (a stop condition or the length limit)."""
        return self.finish_reason in ("stop", "length")

    @property
    def gone(self) -> bool:
        return self.disconnected or self.dropped

    def update(self, out: RequestOutput) -> None:
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        self.output_tokens = max(self.output_tokens, out.output_tokens)
        self.arrival_time = out.arrival_time or self.arrival_time
        self.queue_time = out.queue_time if out.queue_time is not None else self.queue_time
        self.first_token_time = out.first_token_time or self.first_token_time
        if out.token_times:
            self.last_token_time = out.token_times[-1]
        if out.finished:
            self.finish_reason = out.finish_reason
            self.engine_error = out.error

    def fail(self, error: str) -> None:
        self.finish_reason, self.engine_error = "error", error

    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, self.cached_tokens, self.output_tokens)

    def error(self) -> APIError:
        """The server-side failure of this request, in the envelope."""
        detail = self.engine_error or (
            "the server stopped the request"
            if self.finish_reason == "abort"
            else "the request ended unexpectedly"
        )
        return APIError(500, f"The server had an error while generating: {detail}", type="server_error")

    def cost(self, weights: CostWeights) -> float:
        cached = min(self.cached_tokens, self.prompt_tokens)
        return request_cost(self.prompt_tokens - cached, cached, self.output_tokens, weights)

    def outcome(self) -> tuple[str, str | None]:
        """(status, finish_reason) for the ledger; status is "ok", "cancelled" or "error"."""
        if self.dropped:
            return "cancelled", "client_timeout"
        if self.completed and (self.responded or not self.disconnected):
            return "ok", self.finish_reason
        if self.gone or self.finish_reason == "abort":
            return "cancelled", "abort"
        return "error", "error"

    def timings(self) -> dict[str, float | None]:
        """Queue time, TTFT, mean TPOT and end-to-end seconds."""
        start = self.arrival_time or self.job.started
        ttft = self.first_token_time - start if self.first_token_time is not None else None
        tpot = None
        if self.first_token_time is not None and self.last_token_time is not None and self.output_tokens > 1:
            tpot = (self.last_token_time - self.first_token_time) / (self.output_tokens - 1)
        return {"queue_s": self.queue_time, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": time.monotonic() - start}
