"""Seeded benchmark workloads: prompt token ids and output lengths drawn from uniform ranges, and
multi-turn chats after one shared system prompt."""

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
CHAT_TURNS = WorkloadSpec(prompt_len=(16, 128))  # a shared-prefix chat's user turns and answers
CHAT_TURNS_QUICK = WorkloadSpec(num_requests=8, prompt_len=(8, 32), output_len=(8, 32))


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


def derived_seed(seed: int, index: int) -> int:
    """The seed of part ``index`` of a run seeded ``seed``: the same pair always gives the same seed, and
    different indexes give unrelated ones."""
    return random.Random(f"{seed}/{index}").getrandbits(63)


def redraw_prompts(
    requests: Sequence[BenchRequest], token_ids: Sequence[int], seed: int
) -> list[BenchRequest]:
    """The same prompt and output lengths with prompt tokens drawn afresh from ``token_ids`` (seeded)."""
    rng = random.Random(seed)
    return [
        BenchRequest(tuple(rng.choice(token_ids) for _ in range(r.prompt_len)), r.output_len)
        for r in requests
    ]


@dataclass(frozen=True)
class ChatSpec:
    """The shared-prefix workload: ``shape.num_requests`` conversations of ``turns`` user turns, each turn's
    length and output length drawn from ``shape``, all after one system prompt of ``system_len`` tokens."""

    shape: WorkloadSpec
    system_len: int = 768
    turns: int = 3

    def __post_init__(self) -> None:
        if self.system_len < 1 or self.turns < 1:
            raise ValueError("a chat workload needs a system prompt and at least one turn")


@dataclass(frozen=True)
class ChatWorkload:
    """The system prompt's token ids and each conversation's turns (user token ids, output length)."""

    system_ids: tuple[int, ...]
    conversations: list[tuple[BenchRequest, ...]]


def make_chat_workload(spec: ChatSpec, token_ids: Sequence[int], prompt_seed: int) -> ChatWorkload:
    """Lengths drawn with ``spec.shape.seed``; the system prompt and user turns drawn from ``token_ids``
    with ``prompt_seed``, so that another prompt seed gives other text of the same shape."""
    lengths, tokens = random.Random(spec.shape.seed), random.Random(prompt_seed)

    def draw(count: int) -> tuple[int, ...]:
        return tuple(tokens.choice(token_ids) for _ in range(count))

    def turn() -> BenchRequest:
        user_len = lengths.randint(*spec.shape.prompt_len)
        return BenchRequest(draw(user_len), lengths.randint(*spec.shape.output_len))

    system = draw(spec.system_len)
    conversations = [tuple(turn() for _ in range(spec.turns)) for _ in range(spec.shape.num_requests)]
    return ChatWorkload(system, conversations)


def prompt_text(tokenizer, ids: list[int]) -> str:
    """Text that the tokenizer encodes to (about) ``len(ids)`` tokens, made from those ids."""
    target = len(ids)
    text = tokenizer.decode(ids)
    for _ in range(3):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) <= target:
            break
        text = tokenizer.decode(encoded[:target])
    return text


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
