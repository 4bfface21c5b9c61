"""Model directories: clear errors for what cannot be served; the default import is cached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.weights import default_model_dir, import_default_model, resolve_model_dir


def copy_model(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_valid_directory_is_used_in_place(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_dir(str(tiny_model_dir), tmp_path) == tiny_model_dir
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda d: shutil.rmtree(d), "not found"),
        (lambda d: (d / "config.json").unlink(), "no config.json"),
        (lambda d: (d / "model.safetensors").unlink(), "safetensors"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    ],
)
def test_broken_directory_is_refused(tiny_model_dir: Path, tmp_path: Path, breakage, message: str) -> None:
    model_dir = copy_model(tiny_model_dir, tmp_path / "model")
    breakage(model_dir)
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(str(model_dir), tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "'yarn' is not supported",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_architecture_is_refused(tiny_model_dir: Path, tmp_path: Path, change, message) -> None:
    model_dir = copy_model(tiny_model_dir, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(str(model_dir), tmp_path)


def test_imported_default_model_is_reused_not_reimported(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A complete cache entry (here the tiny model's files) is served as it is: importing again would
    # replace it with the 30-layer SmolLM2.
    cached = copy_model(tiny_model_dir, default_model_dir(tmp_path))
    before = {p.name: p.stat().st_mtime_ns for p in cached.iterdir()}
    assert import_default_model(tmp_path, progress=False) == cached
    assert resolve_model_dir(None, tmp_path, progress=False) == cached
    assert {p.name: p.stat().st_mtime_ns for p in cached.iterdir()} == before
    assert json.loads((cached / "config.json").read_text())["num_hidden_layers"] == 2


def test_default_model_import_is_complete(smollm2_dir: Path) -> None:
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
