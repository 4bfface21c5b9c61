"""The model every benchmarked system runs: the same Hugging Face directory, device and token ids."""

from __future__ import annotations

from pathlib import Path


def bench_model_dir(model: str | None, command: str) -> Path:
    """``--model PATH`` checked, or the default SmolLM2 from the state dir cache (imported on first use)."""
    from engine.weights import resolve_model_dir, state_dir_from_env

    try:
        return resolve_model_dir(model, state_dir_from_env())
    except (ValueError, OSError) as exc:
        raise SystemExit(f"weir bench {command}: error: {exc}") from None


def bench_device() -> str:
    """CUDA when present, else CPU: every system of a run uses the same one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
