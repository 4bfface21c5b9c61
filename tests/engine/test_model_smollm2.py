"""The paged model on the real SmolLM2 gives exactly transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

from engine.models import PagedLlama
from engine.tokenizer import Tokenizer
from tests.fixtures.models import SMOL_NEW_TOKENS, SMOL_QUESTIONS, paged_greedy


def test_smollm2_batched_chunked_matches_transformers(
    smollm2_dir: Path,
    smollm2_model: PagedLlama,
    smollm2_prompts: list[list[int]],
    smollm2_reference: list[list[int]],
) -> None:
    got = paged_greedy(smollm2_model, smollm2_prompts, SMOL_NEW_TOKENS, chunk_size=16, block_size=16)
    assert got == smollm2_reference
    france = SMOL_QUESTIONS.index("What is the capital of France?")
    assert "Paris" in Tokenizer(smollm2_dir).decode(smollm2_reference[france])
