"""What one admitted request is (``Job``) and what it used (``Tracker``): the numbers it is settled and
billed with. Billing counts the tokens the tenant asked for and got; recomputed prefill is never here."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from api.backends import PromptSource
from api.errors import APIError
from api.openai_format import ResponseShape, usage_dict
from api.output_allowance import OutputAllowance
from api.refusals import overloaded
from engine.cost import CostWeights, request_cost
from engine.types import RequestOutput, SamplingParams
from tenants.quotas import Reservation


@dataclass
class Job:
    """One request that passed auth, validation, reservation and admission: its data, nothing live."""

    request_id: str
    tenant_id: int
    tenant_name: str
    key_id: int | None
    prompt_ids: list[int]
    params: SamplingParams
    shape: ResponseShape
    stream: bool
    reservation: Reservation  # settled exactly once
    output: OutputAllowance  # the output tokens the reservation covers
    rate_limit_headers: dict[str, str] = field(default_factory=dict)  # the tenant's allowance at admission
    tpot_target_s: float | None = None  # the tenant's time-per-output-token target
    start_within_s: float | None = (
        None  # refused unstarted after this long in the queue (TTFT target + grace)
    )
    weight: float = 1.0  # the tenant's share weight under the fair policy
    source: PromptSource | None = None  # the prompt as sent, for backends that take text (api/pool.py)
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    started: float = field(default_factory=time.monotonic)


@dataclass
class Tracker:
    """Accumulates a request's engine deltas (merged into one) and how its client behaved."""

    job: Job
    total: RequestOutput = field(init=False)  # every delta so far, merged by ``RequestOutput.merge``
    disconnected: bool = False  # the client went away before its answer was complete
    dropped: bool = False  # the client stopped reading for longer than the client timeout
    responded: bool = False  # the last byte of the answer was handed to the server

    def __post_init__(self) -> None:
        self.total = RequestOutput(self.job.request_id)

    @property
    def prompt_tokens(self) -> int:
        """The prompt tokens that ran, as the engine counts them (0 for a request that never started)."""
        return self.total.prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        """The engine's: stop | length | abort | error (``None`` while it runs)."""
        return self.total.finish_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def completed(self) -> bool:
        """The engine ended the request normally (a stop condition or the length limit)."""
        return self.finish_reason in ("stop", "length")

    @property
    def refused(self) -> bool:
        """The engine refused the request unstarted: it waited past its start deadline."""
        return self.finish_reason == "deadline"

    @property
    def gone(self) -> bool:
        return self.disconnected or self.dropped

    def update(self, out: RequestOutput) -> None:
        self.total.merge(out)

    def fail(self, error: str) -> None:
        self.total.finished, self.total.finish_reason, self.total.error = True, "error", error

    def usage(self) -> dict:
        return usage_dict(self.prompt_tokens, self.total.cached_tokens, self.total.output_tokens)

    def error(self) -> APIError:
        """The server-side failure or the refusal of this request, in the envelope."""
        if self.refused:
            return overloaded("deadline", self.job.start_within_s or 1.0)
        detail = self.total.error or (
            "the server stopped the request"
            if self.finish_reason == "abort"
            else "the request ended unexpectedly"
        )
        return APIError(500, f"The server had an error while generating: {detail}", type="server_error")

    def cost(self, weights: CostWeights) -> float:
        cached = min(self.total.cached_tokens, self.prompt_tokens)
        return request_cost(self.prompt_tokens - cached, cached, self.total.output_tokens, weights)

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
        total = self.total
        start = total.arrival_time or self.job.started
        first = total.first_token_time
        ttft = first - start if first is not None else None
        tpot = None
        if first is not None and total.token_times and total.output_tokens > 1:
            tpot = (total.token_times[-1] - first) / (total.output_tokens - 1)
        return {
            "queue_s": total.queue_time,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "e2e_s": time.monotonic() - start,
        }
