"""Sampling through the engine: seeds across batch mixes, stop strings across tokens, UTF-8 deltas."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine.core import EngineCore, generate_offline
from engine.models import PagedLlama
from engine.types import RequestOutput, SamplingParams
from tests.engine.engine_helpers import make_core, random_prompts


def stream(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    core.add_request("s", prompt, params)
    deltas = []
    while core.has_unfinished():
        deltas.extend(core.step())
    return deltas


def test_seeded_request_gives_the_same_tokens_in_any_batch_mix(tiny_model_dir: Path) -> None:
    prompts = random_prompts((9, 40, 3, 25), seed=21)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16)
    single = make_core(tiny_model_dir)
    alone = generate_offline(single, [(prompts[0], seeded)])[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0.5, seed=9, max_tokens=30),
    ]
    crowded = make_core(tiny_model_dir, num_kv_blocks=10, block_size=4, prefill_chunk_size=8)
    mixed = [(prompts[1], others[0]), (prompts[2], others[1]), (prompts[0], seeded), (prompts[3], others[2])]
    together = generate_offline(crowded, mixed)[2].token_ids
    assert crowded.stats().preemptions > 0
    assert together == alone and len(alone) == 16
    reseeded = generate_offline(single, [(prompts[0], replace(seeded, seed=1))])
    assert reseeded[0].token_ids != alone


def test_stop_string_straddling_tokens_ends_the_output_and_is_never_emitted(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    prompt = random_prompts((12,), seed=4)[0]
    free = stream(core, prompt, SamplingParams(temperature=0, max_tokens=24))
    pieces = [d.text for d in free]
    full = "".join(pieces)
    k = next(i for i in range(4, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # spans the boundary between two tokens' text
    stopped = stream(core, prompt, SamplingParams(temperature=0, max_tokens=24, stop=(stop, "never-there")))
    text = "".join(d.text for d in stopped)
    assert text == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].output_tokens <= k + 2
    assert all(stop not in d.text for d in stopped)


@pytest.fixture(scope="module")
def smol_core(smollm2_dir: Path, smollm2_model: PagedLlama) -> EngineCore:
    return make_core(smollm2_dir, smollm2_model)


def test_stop_token_id_ends_the_output_with_its_id_but_no_text(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir)
    prompt = random_prompts((7,), seed=6)[0]
    free = stream(core, prompt, SamplingParams(temperature=0, max_tokens=12))
    ids = [t for d in free for t in d.token_ids]
    stop_id = ids[4]
    cut = ids.index(stop_id)
    stopped = stream(core, prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_id,)))
    assert [t for d in stopped for t in d.token_ids] == ids[: cut + 1]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].output_tokens == cut + 1
    assert "".join(d.text for d in stopped) == core.tokenizer.decode(ids[:cut])


def test_eos_ends_the_answer_unless_ignore_eos(smol_core: EngineCore) -> None:
    prompt = smol_core.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    params = SamplingParams(temperature=0, max_tokens=14)  # the answer to "Hi" is about 10 tokens
    forced_params = replace(params, ignore_eos=True)
    natural, forced = generate_offline(smol_core, [(prompt, params), (prompt, forced_params)])
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in smol_core.eos_token_ids
    assert natural.output_tokens < 14 and natural.text == smol_core.tokenizer.decode(natural.token_ids[:-1])
    assert forced.finish_reason == "length" and forced.output_tokens == 14
    assert forced.token_ids[: natural.output_tokens] == natural.token_ids


def test_multibyte_characters_split_across_tokens_rejoin_exactly(smol_core: EngineCore) -> None:
    core = smol_core
    question = "Write the word 'cat' in Chinese characters and in Japanese."
    prompt = core.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    deltas = stream(core, prompt, SamplingParams(temperature=0, max_tokens=16))
    token_ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert text == core.tokenizer.decode(token_ids)
    assert any(ord(ch) > 0x2E80 for ch in text) and "\ufffd" not in text
    assert any("\ufffd" in core.tokenizer.decode([t]) for t in token_ids), "no character straddled tokens"
    assert all("\ufffd" not in d.text for d in deltas)
