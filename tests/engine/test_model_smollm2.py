"""The paged model on the real SmolLM2 gives exactly transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

from engine.models import load_model
from engine.tokenizer import Tokenizer
from tests.fixtures.models import hf_greedy, paged_greedy

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "List three colors.", "Hi")


def test_smollm2_batched_chunked_matches_transformers(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer(smollm2_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = hf_greedy(smollm2_dir, prompts, 16)
    model = load_model(smollm2_dir)
    assert paged_greedy(model, prompts, 16, chunk_size=16, block_size=16) == expected
    assert "Paris" in tokenizer.decode(expected[0])
