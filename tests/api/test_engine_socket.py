"""``weir engine --socket``: the socket is its user's alone (mode 0600), whatever file a stale one left."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from tests.api.server import start_engine


def test_the_engine_socket_is_private_to_its_user(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    with socket.socket(socket.AF_UNIX) as stale:  # what an engine killed earlier leaves: world-writable
        stale.bind(str(path))
    path.chmod(0o666)
    options = ("--kv-cache-memory", "8", "--log-level", "warning")
    engine = start_engine(tiny_model_dir, tmp_path, *options, unix_socket=True)
    try:
        engine.wait_ready()
        mode = os.stat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert engine.get("/health").json()["status"] == "ok"
    finally:
        engine.stop()
