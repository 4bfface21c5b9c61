"""The paged Llama gives exactly transformers' greedy tokens, with sequences batched and prefill chunked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.models import load_model
from tests.fixtures.models import TINY_SHAPE, hf_greedy, paged_greedy

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


def save_variant(path: Path, config) -> Path:
    """Save a small random model of ``config`` (transformers' own class for its model_type) into ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(99)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(path, safe_serialization=True)
    return path


VARIANT_SHAPE = {**TINY_SHAPE, "vocab_size": 512, "intermediate_size": 96, "max_position_embeddings": 256}
VARIANT_SHAPE.pop("num_key_value_heads")


def qwen2_with_biases(path: Path) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(**VARIANT_SHAPE, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=5000.0)
    return save_variant(path, config)


def llama3_rope_with_biases(path: Path) -> Path:
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = LlamaConfig(
        **VARIANT_SHAPE, num_key_value_heads=4, attention_bias=True, mlp_bias=True, rope_parameters=rope
    )
    return save_variant(path, config)


def llama_linear_rope(path: Path) -> Path:
    from transformers import LlamaConfig

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    return save_variant(path, LlamaConfig(**VARIANT_SHAPE, num_key_value_heads=2, rope_parameters=rope))


@pytest.mark.parametrize("make", [qwen2_with_biases, llama3_rope_with_biases, llama_linear_rope])
def test_family_variants_match_transformers(tmp_path: Path, make) -> None:
    model_dir = make(tmp_path)
    prompts = random_prompts(512)
    expected = hf_greedy(model_dir, prompts, NEW_TOKENS)
    assert paged_greedy(load_model(model_dir), prompts, NEW_TOKENS, chunk_size=16) == expected
