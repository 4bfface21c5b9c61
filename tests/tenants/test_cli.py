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

from tenants.admin import get_tenant, list_keys
from tenants.db import embedded_server

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
    embedded server in it runs; its server's cluster is deleted afterwards, wherever it lives."""
    path = Path(tempfile.mkdtemp(prefix="weir-test-state-"))
    yield path
    embedded_server(path / "postgres").remove()
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
        "unknown key": (["key", "revoke", "acme", "424242"], "no key"),
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


def _key_id(created: subprocess.CompletedProcess[str]) -> str:
    """The key id that ``weir key create`` reports on stderr (``key id N for tenant T: ...``)."""
    assert created.returncode == 0, created.stderr
    return created.stderr.split()[2]


async def _revoked(db_engine, tenant: str) -> dict[int, bool]:
    return {key.id: key.revoked for key in await list_keys(db_engine, tenant)}


async def test_key_revoke_names_the_tenant_and_refuses_another_tenants_key(tmp_path, database_url, db_engine):
    env = _env(tmp_path / "state", database_url)
    for name in ("acme", "globex"):
        assert weir(env, "tenant", "create", name).returncode == 0
    acme_key = _key_id(weir(env, "key", "create", "acme"))
    globex_key = _key_id(weir(env, "key", "create", "globex"))

    refused = weir(env, "key", "revoke", "globex", acme_key)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"tenant globex has no key with id {acme_key}" in refused.stderr
    assert await _revoked(db_engine, "acme") == {int(acme_key): False}

    assert weir(env, "key", "revoke", "acme").returncode == 2  # the tenant is required
    revoked = weir(env, "key", "revoke", "acme", acme_key)
    assert revoked.returncode == 0 and "of tenant acme revoked" in revoked.stdout, revoked.stderr
    assert await _revoked(db_engine, "acme") == {int(acme_key): True}

    globex_id = (await list_keys(db_engine, "globex"))[0].tenant_id
    by_tenant_id = weir(env, "key", "revoke", str(globex_id), globex_key)
    assert by_tenant_id.returncode == 0, by_tenant_id.stderr
    assert await _revoked(db_engine, "globex") == {int(globex_key): True}


async def test_ids_must_be_ascii_digits(tmp_path, database_url, db_engine):
    env = _env(tmp_path / "state", database_url)
    assert weir(env, "tenant", "create", "acme").returncode == 0
    key = _key_id(weir(env, "key", "create", "acme"))
    assert key == "1"  # so that an Arabic-Indic one (U+0661) would name it
    cases = {
        "arabic-indic key": ["key", "revoke", "acme", "\u0661"],
        "superscript key": ["key", "revoke", "acme", "\u00b2"],
        "fullwidth key": ["key", "revoke", "acme", "\uff11"],
        "mixed key": ["key", "revoke", "acme", "1\u00b2"],
        "huge key": ["key", "revoke", "acme", "9" * 20],
        "negative key": ["key", "revoke", "acme", "-1"],
        "arabic-indic tenant": ["key", "revoke", "\u0661", "1"],
        "superscript tenant": ["tenant", "show", "\u00b2"],
        "tenant update": ["tenant", "update", "\u0661", "--weight", "2"],
        "tenant suspend": ["tenant", "suspend", "\u0661"],
        "key create": ["key", "create", "\u0661"],
        "key list": ["key", "list", "\u00b2"],
        "usage tenant": ["usage", "show", "--tenant", "\u0661"],
    }
    processes = {name: _start(env, *args) for name, args in cases.items()}  # in parallel
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 1, (name, out, err)
        assert err.count("\n") == 1 and "ASCII digits" in err and "Traceback" not in err, (name, err)
    assert await _revoked(db_engine, "acme") == {1: False}
    assert (await get_tenant(db_engine, "acme")).active
