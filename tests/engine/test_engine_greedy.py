"""Through the whole engine, batched requests give exactly transformers' greedy tokens for each alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.client import AsyncEngine
from engine.core import generate_offline
from engine.tokenizer import Tokenizer
from engine.types import SamplingParams
from tests.engine.engine_helpers import engine_config, make_core, random_prompts
from tests.fixtures.models import hf_greedy

TINY_PROMPT_LENGTHS = (1, 3, 7, 16, 17, 33, 50, 64, 5)
TINY_NEW_TOKENS = 12
SMOL_NEW_TOKENS = 10
SETUPS = {
    "whole-prompts": {},
    "chunks-of-16": {"prefill_chunk_size": 16, "max_batched_tokens": 40, "max_num_seqs": 16},
    "tiny-kv-pool": {"num_kv_blocks": 24, "block_size": 4, "prefill_chunk_size": 16},
}
SMOL_SETUPS = {
    "whole-prompts": {},
    "chunks-of-16-tiny-kv-pool": {"num_kv_blocks": 16, "prefill_chunk_size": 16},
}
QUESTIONS = (
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Explain in one sentence why the sky is blue, as you would to a curious child who keeps asking why.",
    "2+2=?",
    "Name a famous painting by Leonardo da Vinci and say where it hangs today.",
    "Translate 'good morning' into Spanish.",
)


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=11)
    return prompts, hf_greedy(tiny_model_dir, prompts, TINY_NEW_TOKENS)


@pytest.fixture(scope="module")
def smol_case(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    tokenizer = Tokenizer(smollm2_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts, hf_greedy(smollm2_dir, prompts, SMOL_NEW_TOKENS)


def run_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int, setup: dict) -> list[list[int]]:
    core = make_core(model_dir, **setup)
    params = SamplingParams(temperature=0, max_tokens=new_tokens)
    outputs = generate_offline(core, [(prompt, params) for prompt in prompts])
    stats = core.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.running == stats.waiting == 0
    if "num_kv_blocks" in setup:
        assert stats.preemptions > 0, "the tiny pool was meant to force preemptions"
    assert all(o.finished and o.output_tokens == len(o.token_ids) for o in outputs)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("setup", SETUPS)
def test_tiny_model_engine_matches_transformers(tiny_model_dir: Path, tiny_case, setup: str) -> None:
    prompts, expected = tiny_case
    assert run_greedy(tiny_model_dir, prompts, TINY_NEW_TOKENS, SETUPS[setup]) == expected


@pytest.mark.parametrize("setup", SMOL_SETUPS)
def test_smollm2_engine_matches_transformers(smollm2_dir: Path, smol_case, setup: str) -> None:
    prompts, expected = smol_case
    assert run_greedy(smollm2_dir, prompts, SMOL_NEW_TOKENS, SMOL_SETUPS[setup]) == expected


async def test_async_engine_concurrent_streams_match_transformers(tiny_model_dir: Path, tiny_case) -> None:
    prompts, expected = tiny_case
    params = SamplingParams(temperature=0, max_tokens=TINY_NEW_TOKENS)

    async def collect(i: int) -> list[int]:
        tokens = []
        async for delta in engine.generate(f"r{i}", prompts[i], params):
            tokens.extend(delta.token_ids)
            assert delta.output_tokens == len(tokens)
        assert delta.finished and delta.finish_reason == "length"
        return tokens

    async with AsyncEngine(engine_config(tiny_model_dir, prefill_chunk_size=16)) as engine:
        got = await asyncio.gather(*(collect(i) for i in range(len(prompts))))
        stats = engine.stats()
    assert list(got) == expected
    assert stats.kv_blocks_free == stats.kv_blocks_total
