"""Through the whole engine, batched requests give exactly transformers' greedy tokens for each alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.client import AsyncEngine
from engine.core import generate_offline
from engine.models import PagedLlama
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


@pytest.fixture(scope="module")
def tiny_case(tiny_model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(TINY_PROMPT_LENGTHS, seed=11)
    return prompts, hf_greedy(tiny_model_dir, prompts, TINY_NEW_TOKENS)


def run_greedy(
    model_dir: Path, prompts: list[list[int]], new_tokens: int, setup: dict, model: PagedLlama | None = None
) -> list[list[int]]:
    core = make_core(model_dir, model, **setup)
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
def test_smollm2_engine_matches_transformers(
    smollm2_dir: Path, smollm2_model: PagedLlama, smollm2_prompts, smollm2_reference, setup: str
) -> None:
    assert len({len(p) for p in smollm2_prompts}) == len(smollm2_prompts)
    expected = [tokens[:SMOL_NEW_TOKENS] for tokens in smollm2_reference]
    got = run_greedy(smollm2_dir, smollm2_prompts, SMOL_NEW_TOKENS, SMOL_SETUPS[setup], smollm2_model)
    assert got == expected


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
