"""``AsyncEngine`` loads its model on the engine thread (one thread runs all of the engine's torch work) and
reports a load that fails from ``start()``."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine.client import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.types import SamplingParams


def test_the_model_loads_and_steps_on_the_engine_thread(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: dict[str, str] = {}
    load, step = EngineCore.from_config.__func__, EngineCore.step

    def recording_load(cls, config, progress=True):
        threads["load"] = threading.current_thread().name
        return load(cls, config, progress)

    def recording_step(self):
        threads["step"] = threading.current_thread().name
        return step(self)

    monkeypatch.setattr(EngineCore, "from_config", classmethod(recording_load))
    monkeypatch.setattr(EngineCore, "step", recording_step)

    async def serve_one() -> list[int]:
        config = EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
        async with AsyncEngine(config) as engine:
            tokens = []
            async for delta in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0)):
                tokens += delta.token_ids
            return tokens

    assert len(asyncio.run(serve_one())) == 3
    assert threads == {"load": "weir-engine", "step": "weir-engine"}


def test_a_model_that_fails_to_load_fails_start(tmp_path: Path) -> None:
    async def start() -> AsyncEngine:
        engine = AsyncEngine(EngineConfig(model=str(tmp_path / "missing"), dtype="float32"))
        with pytest.raises(Exception, match="missing"):
            await engine.start()
        return engine

    engine = asyncio.run(start())
    assert engine._thread is None and engine._core is None
    with pytest.raises(RuntimeError, match="not started"):
        _ = engine.core
