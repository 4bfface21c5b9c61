"""``weir db|tenant|key|usage`` as a user runs them: separate processes, one-line errors, no tracebacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env(state_dir: Path, database_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(WEIR_STATE_DIR=str(state_dir), PYTHONPATH=str(ROOT))
    if database_url is not None:
        env["DATABASE_URL"] = database_url
    return env


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "api.cli", *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def weir(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    process = _start(env, *args)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.fixture
def own_state_dir() -> Iterator[Path]:
    """A state directory outside pytest's basetemp, which a concurrent pytest session may prune while the
    embedded server in it runs."""
    path = Path(tempfile.mkdtemp(prefix="weir-test-state-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_embedded_database_persists_between_commands(own_state_dir):
    env = _env(own_state_dir, None)
    try:
        assert weir(env, "db", "upgrade").returncode == 0
        created = weir(env, "tenant", "create", "acme", "--cost-per-minute", "5000", "--max-concurrency", "8")
        assert created.returncode == 0, created.stderr
        key = weir(env, "key", "create", "acme")
        assert key.returncode == 0, key.stderr
        secret = key.stdout.strip()
        assert secret.startswith("wk-") and len(secret) >= 43
        shown = weir(env, "tenant", "show", "acme")
        assert shown.returncode == 0 and secret[:10] in shown.stdout and secret not in shown.stdout
        assert "5000" in shown.stdout
    finally:
        stopped = weir(env, "db", "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    assert "not running" in weir(env, "db", "stop").stdout


def test_bad_input_gets_one_line_and_a_nonzero_exit(tmp_path, database_url):
    env = _env(tmp_path / "state", database_url)
    assert weir(env, "tenant", "create", "acme").returncode == 0
    cases = {
        "duplicate": (["tenant", "create", "acme"], "already exists"),
        "negative": (["tenant", "create", "neg", "--monthly-budget", "-5"], "--monthly-budget"),
        "zero concurrency": (["tenant", "update", "acme", "--max-concurrency", "0"], "concurrency"),
        "bad name": (["tenant", "create", "no spaces"], "invalid tenant name"),
        "unknown tenant": (["key", "create", "nobody"], "no tenant"),
        "unknown key": (["key", "revoke", "424242"], "no key"),
        "bad date": (["usage", "show", "--since", "yesterday"], "--since"),
    }
    processes = {name: _start(env, *args) for name, (args, _) in cases.items()}  # in parallel
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert process.returncode == 1, (name, out, err)
        assert len(lines) == 1 and lines[0].startswith("weir "), (name, err)
        assert cases[name][1] in lines[0], (name, lines[0])
        assert "Traceback" not in err


def test_unreachable_database_is_one_line(tmp_path):
    env = _env(tmp_path / "state", "postgresql://postgres@/postgres?host=/nonexistent-weir-dir&port=5432")
    result = weir(env, "tenant", "list")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
