"""``weir generate``, ``weir model import`` and ``weir engine``'s refusals as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WEIR = [sys.executable, "-m", "api.cli"]
ROOT = Path(__file__).resolve().parents[2]


def weir(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*WEIR, *args], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=timeout
    )


def test_generate_answers_the_capital_of_france_with_paris(smollm2_dir: Path) -> None:
    result = weir("generate", "--max-tokens", "32", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_model_import_reports_the_cached_model_and_bad_input_is_one_clear_line(smollm2_dir: Path) -> None:
    imported = weir("model", "import")
    assert imported.returncode == 0, imported.stderr
    assert Path(imported.stdout.strip()).resolve() == smollm2_dir.resolve()
    missing = weir("generate", "--model", str(ROOT / "no-such-model"), "hi")
    assert missing.returncode == 1
    assert missing.stderr.startswith("weir generate: error: ") and "Traceback" not in missing.stderr
    bad = weir("generate", "--temperature", "-1", "hi")
    assert bad.returncode == 1 and "temperature" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("host", "allow_remote", "refused"),
    [
        ("0.0.0.0", False, True),
        ("engine.example", False, True),
        ("0.0.0.0", True, False),
        ("127.0.0.2", False, False),
        ("localhost", False, False),
    ],
)
def test_engine_listens_beyond_loopback_only_with_allow_remote(
    tmp_path: Path, host: str, allow_remote: bool, refused: bool
) -> None:
    """Each run stops at the first error: the host when it is refused, else the missing model."""
    options = ["--allow-remote"] if allow_remote else []
    result = weir("engine", "--port", "9000", "--host", host, *options, "--model", str(tmp_path / "none"))
    assert result.returncode == 1 and result.stderr.startswith("weir engine: error: ")
    assert ("not a loopback address" in result.stderr) is refused, result.stderr
    assert ("--allow-remote" in result.stderr) is refused and "Traceback" not in result.stderr
