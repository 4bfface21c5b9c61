"""One request's state inside the engine: its tokens, how many have KV in the cache, and its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.types import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request being served: prompt plus the tokens sampled so far.

    ``num_computed_tokens`` tokens have their K/V in the cache; the rest (the prompt not yet prefilled, or
    after a preemption everything) is computed by the next steps. The last token never has K/V until it is
    the query of a decode step.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant_id: str = "default"
    priority: int = 0
    weight: float = 1.0  # the tenant's share weight under the fair policy
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_prompt_tokens_billed: int = 0  # high-water mark: recomputed prefill is never counted twice
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    expected_cached_tokens: int = 0  # prompt tokens the prefix cache held at arrival (for estimates only)
    status: SequenceStatus = SequenceStatus.WAITING
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    predicted_ttft: float | None = None  # the engine's estimate when the request arrived
    tpot_target_s: float | None = None  # the time per output token its client was promised, if any
    start_deadline: float | None = None  # time.monotonic() after which it is refused rather than started

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
