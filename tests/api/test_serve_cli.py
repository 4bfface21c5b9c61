"""``weir serve`` and ``weir engine`` refuse bad settings with one line on stderr before loading anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("command", "args", "message"),
    [
        ("serve", ["--model", "/nonexistent/model"], "model directory not found"),
        ("serve", ["--client-timeout", "0"], "--client-timeout must be positive"),
        ("serve", ["--header-timeout", "0"], "--header-timeout must be positive"),
        ("serve", ["--policy", "lottery"], "--policy must be one of"),
        ("serve", ["--port", "70000"], "--port must be in 1..65535"),
        (
            "serve",
            ["--backend", "ftp://10.0.0.5"],
            "backend URL must start with http:// or https:// or unix:",
        ),
        ("serve", ["--backends", "/nonexistent/pool.toml"], "--backends /nonexistent/pool.toml: "),
        ("engine", ["--port", "70000"], "--port must be in 1..65535"),
        ("engine", ["--port", "9000", "--max-num-seqs", "0"], "--max-num-seqs must be positive"),
    ],
)
def test_bad_settings_are_one_line_errors(command: str, args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "api.cli", command, *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.startswith(f"weir {command}: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER: unsupported exporter zipkin"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTLP protocol 'grpc' is not supported",
        ),
    ],
)
def test_unsupported_telemetry_settings_are_one_line_errors(env: dict[str, str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", "--model", "/nonexistent/model"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 1
    assert result.stderr.startswith("weir serve: error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
