"""Helpers shared by the engine tests: building a core on a model directory, random prompts."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import KVCacheManager


def make_core(model_dir: Path, **config) -> EngineCore:
    """A CPU core on ``model_dir`` with a small KV pool unless ``config`` says otherwise."""
    return EngineCore.from_config(engine_config(model_dir, **config), progress=False)


def engine_config(model_dir: Path, **config) -> EngineConfig:
    config.setdefault("num_kv_blocks", 256)
    return EngineConfig(model=str(model_dir), device="cpu", **config)


def random_prompts(lengths: tuple[int, ...], seed: int, vocab_size: int = 49152) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def assert_blocks_owned_once(kv: KVCacheManager) -> None:
    """Every block is either free or in exactly one table, with one reference (no prefix sharing)."""
    owned = [block for table in kv.block_tables.values() for block in table]
    assert len(owned) == len(set(owned)), "a block is in two tables"
    assert all(kv.allocator.ref_count(block) == 1 for block in owned)
    assert len(owned) + kv.num_free_blocks == kv.num_blocks
