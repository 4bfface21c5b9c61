"""The model's side of the engine contract: cache sizing, config, and refusals of bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.batch import StepBatch
from engine.models import PagedLlama, load_model


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> PagedLlama:
    return load_model(tiny_model_dir)


def one_prompt(ids: list[int], start: int = 0) -> StepBatch:
    n = len(ids)
    return StepBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(start, start + n),
        slot_mapping=torch.arange(start, start + n),
        query_lens=[n],
        context_lens=[start + n],
        block_tables=[list(range(-(-(start + n) // 4)))],
        logits_indices=torch.tensor([n - 1]),
        num_decodes=0,
    )


def test_config_and_cache_sizing(tiny: PagedLlama) -> None:
    cfg = tiny.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.vocab_size, cfg.eos_token_ids, cfg.bos_token_id) == (49152, (2,), 1)
    kv = tiny.new_kv_cache(num_blocks=5, block_size=4)
    assert len(kv.keys) == len(kv.values) == cfg.num_layers and kv.block_size == 4
    assert kv.keys[0].shape == (20, cfg.num_kv_heads, cfg.head_dim)
    held = sum(t.numel() * t.element_size() for t in kv.keys + kv.values)
    assert held == 5 * tiny.kv_bytes_per_block(4)
    with pytest.raises(ValueError, match="at least one block"):
        tiny.new_kv_cache(0, 4)


def test_forward_writes_kv_and_returns_requested_rows(tiny: PagedLlama) -> None:
    kv = tiny.new_kv_cache(num_blocks=4, block_size=4)
    batch = one_prompt([5, 6, 7, 8, 9])
    batch.logits_indices = torch.tensor([1, 4])
    logits = tiny.forward(batch, kv)
    assert logits.shape == (2, tiny.config.vocab_size) and logits.dtype == torch.float32
    assert kv.keys[1][:5].abs().sum(dim=(1, 2)).gt(0).all()
    assert kv.keys[1][5:].abs().sum() == 0


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (one_prompt([5, 49152]), "token ids"),
        (one_prompt([5, -1]), "token ids"),
        (one_prompt([5, 6], start=2047), "beyond the model's context"),
    ],
)
def test_bad_step_is_refused(tiny: PagedLlama, batch: StepBatch, message: str) -> None:
    kv = tiny.new_kv_cache(num_blocks=600, block_size=4)
    with pytest.raises(ValueError, match=message):
        tiny.forward(batch, kv)


def test_missing_weight_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(model_dir)
