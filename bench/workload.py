"""Seeded benchmark workloads: prompt token ids and output lengths drawn from uniform ranges."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt's token ids and exactly how many tokens it must generate."""

    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of a workload: request count and inclusive uniform ranges of prompt and output lengths."""

    num_requests: int = 32
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (32, 128)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("a workload needs at least one request")
        for name, (low, high) in (("prompt", self.prompt_len), ("output", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} length range must satisfy 1 <= low <= high, got {low}..{high}")


FULL = WorkloadSpec()
QUICK = WorkloadSpec(num_requests=8, prompt_len=(16, 128), output_len=(8, 32))


def make_workload(spec: WorkloadSpec, token_ids: Sequence[int]) -> list[BenchRequest]:
    """Draw ``spec.num_requests`` requests whose prompts are random picks from ``token_ids``.

    ``token_ids`` should be the tokenizer's ordinary (non-special) ids, so every prompt is real model input.
    The same spec and ids always give the same workload.
    """
    if not token_ids:
        raise ValueError("token_ids must not be empty")
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        prompt = tuple(rng.choice(token_ids) for _ in range(prompt_len))
        requests.append(BenchRequest(prompt_ids=prompt, output_len=output_len))
    return requests


def ordinary_token_ids(tokenizer) -> list[int]:
    """The ids of a Hugging Face tokenizer that are not special or added tokens."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


@dataclass
class SystemResult:
    """What one system did with the workload, timed from first submission to last token."""

    name: str
    seconds: float
    output_tokens: int  # tokens the workload asked for and got
    computed_tokens: int  # output tokens the system generated, wasted ones included
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def check_lengths(name: str, got: list[int], wanted: list[int]) -> None:
    """Fail loudly when a system did not generate exactly the tokens each request asked for."""
    if got != wanted:
        raise RuntimeError(f"{name} generated {sum(got)} tokens where the workload asked for {sum(wanted)}")
