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

from bench.ceiling import ModelShape


class PeerServerError(RuntimeError):
    """The peer server did not come up."""


def free_port(port: int = 0) -> int:
    """``port`` if nothing listens on it (any free port for 0), else PeerServerError."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise PeerServerError(f"port {port} is not free: {exc.strerror}") from None
        return sock.getsockname()[1]


PAGE_SIZE = 256  # tokens per block of transformers' continuous batching cache (its default page size)


def kv_blocks_for(model_dir: Path, kv_bytes: int) -> int:
    """How many of transformers' fp32 cache blocks (``PAGE_SIZE`` tokens of K and V, all layers) fit."""
    shape = ModelShape.from_model_dir(model_dir)
    per_block = shape.layers * PAGE_SIZE * 2 * shape.kv_heads * shape.head_dim * 4
    return max(1, kv_bytes // per_block)


def transformers_serve_command(model_dir: Path, port: int, device: str, kv_bytes: int) -> list[str]:
    serve = ["-m", "transformers.cli.transformers", "serve", str(model_dir), "--continuous-batching"]
    options = {
        "--host": "127.0.0.1",
        "--port": port,
        "--device": device,
        "--dtype": "float32",
        "--log-level": "warning",
        "--cb-num-blocks": kv_blocks_for(model_dir, kv_bytes),
    }
    return [sys.executable, *serve, *(str(x) for pair in options.items() for x in pair)]


@contextmanager
def transformers_server(
    model_dir: Path, port: int, device: str, kv_bytes: int, log_path: Path, ready_timeout_s: float = 300
) -> Iterator[str]:
    """Run the server until the block exits; yields its OpenAI base URL once ``/v1/models`` answers.

    Its KV cache is sized to ``kv_bytes`` (left alone, it takes most of the free memory of the machine).
    """
    base_url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            transformers_serve_command(model_dir, port, device, kv_bytes), stdout=log, stderr=log
        )
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
            raise PeerServerError(f"transformers serve exited with status {proc.returncode}:\n{tail}")
        try:
            if httpx.get(base_url + "/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise PeerServerError(f"transformers serve did not answer within {timeout_s:.0f}s (log: {log_path})")
