"""Run ``weir serve`` in a subprocess for a benchmark and read its state: RSS and the engine's admin JSON."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
LOG_TAIL = 3000  # characters of the server's log shown when it failed


class ServerError(RuntimeError):
    """``weir serve`` did not come up."""


@dataclass
class WeirProcess:
    """A running ``weir serve`` on a loopback port: its process, log and admin token."""

    process: subprocess.Popen
    port: int
    admin_token: str
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def check_alive(self) -> None:
        """ServerError, with the end of its log, once the process has exited."""
        if self.process.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-LOG_TAIL:]
            raise ServerError(f"weir serve exited with status {self.process.returncode}:\n{tail}")

    def rss_bytes(self) -> int:
        """The server process's resident set size (``VmRSS`` of ``/proc/<pid>/status``)."""
        return read_rss_bytes(self.process.pid)

    def cpu_seconds(self) -> float:
        """CPU time the server process has used, user and system, all its threads."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

    def main_thread_cpu_seconds(self) -> float:
        """CPU time of the server's main thread alone, its event loop (not the engine's threads), to the
        nanosecond (``schedstat``; ``stat`` counts in clock ticks of 10 ms)."""
        pid = self.process.pid
        return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9

    async def engine_stats(self, client: httpx.AsyncClient) -> dict:
        """``GET /admin/api/engine``: the engine's running/waiting counts, KV blocks and the API counters."""
        response = await client.get(f"{self.base_url}/admin/api/engine", headers=self.admin_headers)
        response.raise_for_status()
        return response.json()


def read_rss_bytes(pid: int) -> int:
    """``VmRSS`` of a live process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise ValueError(f"unexpected VmRSS unit {unit!r}")
            return int(value) * 1024
    raise ValueError(f"process {pid} reports no VmRSS")


@contextmanager
def weir_serve(
    model_dir: Path,
    port: int,
    database_url: str,
    state_dir: Path,
    *options: str,
    env: dict[str, str] | None = None,
) -> Iterator[WeirProcess]:
    """``weir serve --model model_dir --port port *options`` on ``database_url`` with a fresh admin token
    and ``env`` added to the environment, yielded once ``/readyz`` answers 200; its output goes to
    ``state_dir/server.log``. It shares this process's built kernels (``kernel_dir``), so a fresh state
    directory does not compile them again.

    On exit it is stopped with SIGTERM (a graceful shutdown: in-flight requests settle, the usage ledger is
    flushed) and killed only if it has not exited after ``STOP_TIMEOUT_S``.
    """
    from engine.models.extension import kernel_dir

    token = secrets.token_urlsafe(24)
    env = {
        "WEIR_KERNEL_DIR": str(kernel_dir()),
        **os.environ,
        **(env or {}),
        "DATABASE_URL": database_url,
        "WEIR_ADMIN_TOKEN": token,
        "WEIR_STATE_DIR": str(state_dir),
    }
    command = [sys.executable, "-m", "api.cli", "serve", "--model", str(model_dir), "--port", str(port)]
    log_path = state_dir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*command, *options], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
    server = WeirProcess(process, port, token, log_path)
    try:
        _wait_ready(server)
        yield server
    finally:
        stop(process)


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, wait for the exit, SIGKILL after ``STOP_TIMEOUT_S``; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def _wait_ready(server: WeirProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        server.check_alive()
        try:
            if httpx.get(f"{server.base_url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise ServerError(f"weir serve was not ready within {READY_TIMEOUT_S:.0f}s (log: {server.log_path})")
