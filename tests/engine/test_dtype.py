"""The compute dtype: ``auto`` takes the fastest measured; bf16 gives transformers' bf16 tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine.models import load_model
from engine.models.config import ModelConfig
from engine.models.dtype_choice import (
    KERNEL_ENV,
    PAD_ENV,
    PAD_GAIN,
    PAD_ROWS,
    PRODUCTS,
    ROWS,
    choose_dtype,
    pad_small_batches,
)
from tests.engine.engine_helpers import make_core, random_prompts
from tests.engine.test_engine_greedy import run_greedy
from tests.engine.test_model_interface import one_prompt
from tests.fixtures.models import hf_greedy

NEW_TOKENS = 16


def test_auto_takes_the_candidate_with_the_fastest_measured_steps(tiny_model_dir: Path) -> None:
    choice = choose_dtype(ModelConfig.from_dir(tiny_model_dir), torch.device("cpu"))
    assert set(choice.seconds) == {"float32", "bfloat16"}
    assert all(len(times) == len(ROWS) and min(times) > 0 for times in choice.seconds.values())
    fastest = min(choice.seconds, key=lambda name: math.prod(choice.seconds[name]))
    assert choice.dtype == getattr(torch, fastest) and choice.min_rows in (1, PAD_ROWS)
    assert set(choice.plans) == set(choice.product_seconds) == set(PRODUCTS)
    for product, kernels in choice.product_seconds.items():
        assert kernels and all(len(times) == len(ROWS) for times in kernels.values())
        # each product runs each row count with its kernel measured fastest there (the logits projection
        # is judged only at the counts it runs: at most PAD_ROWS rows)
        for i, rows in enumerate(ROWS):
            if product != "lm_head" or rows <= PAD_ROWS:
                quickest = min(kernels, key=lambda k, i=i: kernels[k][i])
                assert choice.plans[product].kernel_for(rows) == quickest
    # a dtype's step is the sum of its products, each by its fastest kernel
    best = choice.seconds[str(choice.dtype).removeprefix("torch.")]
    for i in range(len(ROWS)):
        fastest_sum = sum(min(t[i] for t in kernels.values()) for kernels in choice.product_seconds.values())
        assert best[i] == pytest.approx(fastest_sum)
    only = choose_dtype(ModelConfig.from_dir(tiny_model_dir), torch.device("cpu"), ("float32",))
    assert only.dtype == torch.float32 and set(only.seconds) == {"float32"}


def test_the_kernel_can_be_pinned_for_runs_that_compare_like_with_like(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, cpu = ModelConfig.from_dir(tiny_model_dir), torch.device("cpu")
    monkeypatch.setenv(KERNEL_ENV, "aten")
    pinned = choose_dtype(config, cpu, ("float32",))
    assert all(plan.kernels == ("aten",) for plan in pinned.plans.values())
    assert all(set(kernels) == {"aten"} for kernels in pinned.product_seconds.values())
    monkeypatch.setenv(KERNEL_ENV, "mkl")
    with pytest.raises(ValueError, match=KERNEL_ENV):
        choose_dtype(config, cpu, ("float32",))


def test_padding_small_batches_can_be_pinned(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, cpu = ModelConfig.from_dir(tiny_model_dir), torch.device("cpu")
    for wanted, min_rows in (("yes", PAD_ROWS), ("no", 1)):
        monkeypatch.setenv(PAD_ENV, wanted)
        assert choose_dtype(config, cpu, ("float32",)).min_rows == min_rows
    monkeypatch.setenv(PAD_ENV, "sometimes")
    with pytest.raises(ValueError, match=PAD_ENV):
        choose_dtype(config, cpu, ("float32",))


def test_small_batches_are_padded_only_when_that_is_clearly_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PAD_ENV, raising=False)
    assert pad_small_batches(padded_s=0.5, single_s=1.0)
    assert pad_small_batches(padded_s=PAD_GAIN, single_s=1.0)
    assert not pad_small_batches(padded_s=0.97, single_s=1.0)  # within the timing's noise: not padded
    assert not pad_small_batches(padded_s=1.2, single_s=1.0)


def test_the_engine_runs_and_caches_in_the_chosen_dtype(tiny_model_dir: Path) -> None:
    core = make_core(tiny_model_dir, dtype="auto")
    assert core.runner.model.dtype in (torch.float32, torch.bfloat16)
    assert core.runner.kv_tensors.keys[0].dtype == core.runner.model.dtype


def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def test_bfloat16_greedy_tokens_match_transformers_in_bfloat16(
    smollm2_dir: Path, smollm2_prompts: list[list[int]]
) -> None:
    """Same tokens as transformers in bf16, except at near-ties: where the two tokens' logits are within two
    bf16 roundings of each other in transformers' own full forward in bf16 or in fp32 (there the order of
    roundings decides, and no kernel order is canonical: on a CPU with AMX, transformers' cached generate
    and its own full forward can order a near-tie apart; on an AVX512-BF16 EPYC two of the eight prompts
    meet an exact bf16 tie or one within a rounding)."""
    from transformers import AutoModelForCausalLM

    prompts = smollm2_prompts
    expected = hf_greedy(smollm2_dir, prompts, NEW_TOKENS, dtype="bfloat16")
    got = run_greedy(smollm2_dir, prompts, NEW_TOKENS, {"dtype": "bfloat16"})
    assert sum(e == g for e, g in zip(expected, got, strict=True)) >= len(prompts) // 2
    references = [
        AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype).eval()
        for dtype in (torch.bfloat16, torch.float32)
    ]
    for prompt, want, have in zip(prompts, expected, got, strict=True):
        if want == have:
            continue
        at = next(i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b)
        gaps = []
        for reference in references:
            logits = _hf_logits(reference, prompt + want[:at])
            gaps.append(abs(float(logits[want[at]] - logits[have[at]])) / float(logits[want[at]].abs()))
        assert min(gaps) <= 2 * 2**-8, (at, gaps)


def test_a_step_that_needs_no_logits_runs_padded(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, "cpu", "bfloat16")
    model.min_rows = PAD_ROWS
    batch = one_prompt(random_prompts((6,), seed=23)[0])
    batch.logits_indices = batch.logits_indices[:0]  # a prefill chunk that does not end its prompt
    assert model.forward(batch, model.new_kv_cache(4, 4)).shape == (0, model.config.vocab_size)


@pytest.mark.parametrize("rows", [1, 3])
def test_padding_small_batches_changes_no_logit_beyond_rounding(tiny_model_dir: Path, rows: int) -> None:
    model = load_model(tiny_model_dir, "cpu", "bfloat16")
    batch = one_prompt(random_prompts((rows,), seed=22)[0])
    logits = {}
    for min_rows in (1, PAD_ROWS):
        model.min_rows = min_rows
        logits[min_rows] = model.forward(batch, model.new_kv_cache(4, 4))
    torch.testing.assert_close(logits[1], logits[PAD_ROWS], rtol=2**-7, atol=2**-7)
