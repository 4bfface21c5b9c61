"""Start `transformers serve --continuous-batching` in a subprocess: the serve benchmark's peer."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def transformers_serve_command(model_dir: Path, port: int, device: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        device,
        "--dtype",
        "float32",
        "--log-level",
        "warning",
    ]


@contextmanager
def transformers_server(
    model_dir: Path, port: int, device: str, log_path: Path, ready_timeout_s: float = 300
) -> Iterator[str]:
    """Run the server until the block exits; yields its OpenAI base URL once ``/v1/models`` answers."""
    base_url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(transformers_serve_command(model_dir, port, device), stdout=log, stderr=log)
    try:
        _wait_ready(proc, base_url, log_path, ready_timeout_s)
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"transformers serve exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"transformers serve did not answer within {timeout_s:.0f}s (log: {log_path})")
