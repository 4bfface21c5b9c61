"""Helpers shared by the engine tests: building a core on a model directory, random prompts."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from engine.batch import StepBatch
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import KVCacheManager
from engine.model_runner import step_batch
from engine.models import PagedLlama
from engine.scheduler import Scheduler, StepPlan
from engine.tokenizer import Tokenizer


def make_core(model_dir: Path, model: PagedLlama | None = None, **config) -> EngineCore:
    """A CPU core on ``model_dir`` with a small KV pool unless ``config`` says otherwise: over ``model``
    (loaded from ``model_dir`` in ``config``'s dtype) where given, else loading its own."""
    settings = engine_config(model_dir, **config)
    if model is None:
        return EngineCore.from_config(settings, progress=False)
    return EngineCore(
        model,
        Tokenizer(model_dir),
        settings,
        num_blocks=settings.num_kv_blocks,
        device=torch.device("cpu"),
        model_name=model_dir.name,
    )


def engine_config(model_dir: Path, **config) -> EngineConfig:
    config.setdefault("num_kv_blocks", 256)
    config.setdefault("dtype", "float32")  # exact comparisons with transformers in fp32
    return EngineConfig(model=str(model_dir), device="cpu", **config)


def run_plan(scheduler: Scheduler) -> tuple[StepPlan, StepBatch | None]:
    """Plan a step, lay it out as the model runner would, and complete it as if the model ran."""
    plan = scheduler.schedule()
    batch = step_batch(plan.scheduled, scheduler.kv, torch.device("cpu")) if plan.scheduled else None
    scheduler.complete(plan)
    return plan, batch


def random_prompts(lengths: tuple[int, ...], seed: int, vocab_size: int = 49152) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def assert_block_references_match(kv: KVCacheManager, request_ids: Iterable[str]) -> None:
    """Every block is free or held by the tables of ``request_ids``, with one reference per table that holds
    it; a block is in a table at most once, and only prefix-cache blocks are in several."""
    owned: dict[int, int] = {}
    for table in map(kv.table, request_ids):
        assert len(table) == len(set(table)), "a block is twice in one table"
        for block in table:
            owned[block] = owned.get(block, 0) + 1
    assert all(kv.allocator.ref_count(block) == count for block, count in owned.items())
    assert len(owned) + kv.num_free_blocks == kv.num_blocks
