"""Building and loading the engine's C++ extensions (``csrc/``) with ``torch.utils.cpp_extension``.

An extension is compiled just in time into ``$WEIR_KERNEL_DIR/<torch version>-<cpu>/`` (default
``<state_dir>/kernels``) the first time it is needed (logged, tens of seconds) and loaded from there
afterwards; processes with different state directories can share one build through ``WEIR_KERNEL_DIR``. The
code is compiled for this CPU's instruction set (``-march=native``), so the directory is keyed by the CPU's
feature flags. Builders take an advisory lock on ``build.flock`` in that directory, which the system drops
when a process dies: torch's own ``lock`` file, left behind by a build that was killed, would otherwise make
every later start wait for it forever, so a builder holding the advisory lock removes it. When an
extension cannot be built or loaded (no compiler, a failed compile), one warning is
logged and the caller keeps its pure-torch path.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.weights import state_dir_from_env

log = logging.getLogger("weir.engine")

CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_loaded: dict[str, bool] = {}  # extension name -> whether it loaded (and passed its check), once a process
_loaded_lock = threading.Lock()


def kernel_dir() -> Path:
    """Where built kernels are kept: ``$WEIR_KERNEL_DIR``, else ``<state_dir>/kernels``."""
    return Path(os.environ.get("WEIR_KERNEL_DIR") or state_dir_from_env() / "kernels")


def extension_ready(
    name: str, source: Path, what: str, fallback: str, check: Callable[[], bool] | None = None
) -> bool:
    """``load_extension`` the first time it is asked for ``name`` in this process (callers on any thread
    wait for that one build), then ``check`` (a probe of the loaded ops), if given; the answer is kept."""
    ready = _loaded.get(name)
    if ready is not None:
        return ready
    with _loaded_lock:
        if name not in _loaded:
            _loaded[name] = load_extension(name, source, what, fallback) and (check is None or check())
        return _loaded[name]


def load_extension(name: str, source: Path, what: str, fallback: str) -> bool:
    """Build ``source`` as library ``name`` (when missing or older than the source) and load it; False, with
    one warning naming ``what`` and the ``fallback`` taken instead, if that fails."""
    build_dir = kernel_dir() / build_tag()
    library = build_dir / f"{name}.so"
    built = library.exists() and library.stat().st_mtime >= source.stat().st_mtime
    started = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        if not built:
            log.info("building the %s into %s (once, tens of seconds)", what, build_dir)
        with open(build_dir / "build.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # released by the system if this process dies
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed build
            cpp_extension.load(
                name=name,
                sources=[str(source)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
            )
    except Exception as exc:  # a missing compiler or a failed build leaves the reference path working
        reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        log.warning("%s unavailable (%s); %s", what, reason[0], fallback)
        log.debug("%s build output:\n%s", what, exc)
        return False
    if not built:
        log.info("%s built in %.1f s", what, time.perf_counter() - started)
    return True


def cpu_flags() -> set[str]:
    """This CPU's feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    return set(_flags_line().partition(":")[2].split())


def build_tag() -> str:
    """Torch's version and a digest of this CPU's feature flags (the code is compiled with -march=native)."""
    flags = _flags_line() or platform.processor()
    digest = hashlib.blake2b(f"{platform.machine()} {flags}".encode(), digest_size=6).hexdigest()
    return f"torch-{torch.__version__}-{platform.machine()}-{digest}"


def _flags_line() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return ""


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` package's binary may not be on it."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
