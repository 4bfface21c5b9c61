"""The paged Llama gives exactly transformers' greedy tokens, with sequences batched and prefill chunked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import load_model
from tests.fixtures.models import hf_greedy, paged_greedy

PROMPT_LENGTHS = (1, 3, 7, 16, 17, 33, 50, 64, 5)
NEW_TOKENS = 12


def random_prompts(vocab_size: int, seed: int = 7) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(49152)
    return prompts, hf_greedy(tiny_model_dir, prompts, NEW_TOKENS)


@pytest.mark.parametrize("chunk_size", [1 << 30, 16, 5])
def test_tiny_llama_matches_transformers(tiny_model_dir: Path, tiny_reference, chunk_size: int) -> None:
    prompts, expected = tiny_reference
    model = load_model(tiny_model_dir)
    got = paged_greedy(model, prompts, NEW_TOKENS, chunk_size=chunk_size)
    assert got == expected
