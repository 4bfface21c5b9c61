"""The one currency of Weir: GPU cost units per request (docs/architecture.md, "The cost unit")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostWeights:
    """Per-model weights; the defaults follow published per-token prices (1 : 0.1 : 2)."""

    prefill: float = 1.0
    cached: float = 0.1
    decode: float = 2.0

    def __post_init__(self) -> None:
        if min(self.prefill, self.cached, self.decode) < 0:
            raise ValueError("cost weights must be non-negative")


DEFAULT_WEIGHTS = CostWeights()


def request_cost(
    uncached_prompt_tokens: int,
    cached_prompt_tokens: int,
    output_tokens: int,
    weights: CostWeights = DEFAULT_WEIGHTS,
) -> float:
    """Cost of a request's tokens; recomputed prefill after preemption is never counted here."""
    if min(uncached_prompt_tokens, cached_prompt_tokens, output_tokens) < 0:
        raise ValueError("token counts must be non-negative")
    return (
        weights.prefill * uncached_prompt_tokens
        + weights.cached * cached_prompt_tokens
        + weights.decode * output_tokens
    )


def worst_case_cost(prompt_tokens: int, max_tokens: int, weights: CostWeights = DEFAULT_WEIGHTS) -> float:
    """The reservation for a request: every prompt token uncached and every allowed output token used."""
    return request_cost(prompt_tokens, 0, max_tokens, weights)
