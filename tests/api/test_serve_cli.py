"""``weir serve`` refuses bad settings with one line on stderr before loading anything."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent/model"], "model directory not found"),
        (["--client-timeout", "0"], "--client-timeout must be positive"),
        (["--header-timeout", "0"], "--header-timeout must be positive"),
        (["--policy", "lottery"], "--policy must be one of"),
        (["--port", "70000"], "--port must be in 1..65535"),
    ],
)
def test_bad_settings_are_one_line_errors(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.startswith("weir serve: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
