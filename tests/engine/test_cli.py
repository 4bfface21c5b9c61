"""``weir generate`` and ``weir model import`` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
