"""The C++ paged attention kernel (``csrc/paged_attention.cpp``): attention that reads the KV blocks in place.

The extension is compiled just in time by ``torch.utils.cpp_extension`` into
``$WEIR_KERNEL_DIR/<torch version>-<cpu>/`` (default ``<state_dir>/kernels``) the first time a CPU step asks
for it (logged, tens of seconds) and loaded from there afterwards; processes with different state directories
can share one build through ``WEIR_KERNEL_DIR``. It is built for this CPU's instruction set, so the
directory is keyed by the CPU's feature flags. When it cannot be built or loaded (no compiler, a failed
compile), one warning is logged and :func:`kernel_available` is False: attention then takes the reference
gather + SDPA path.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.batch import StepBatch
from engine.weights import state_dir_from_env

log = logging.getLogger("weir.engine")

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
NAME = "weir_paged_attention"
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is compiled for
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_load_lock = threading.Lock()


def kernel_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs a step on ``device`` in ``dtype``: CPU, fp32 or bf16, a compiled head size."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def kernel_available() -> bool:
    """Build (first time only) and load the extension; False, with a warning logged once, if that fails."""
    with _load_lock:
        return _load()


def kernel_dir() -> Path:
    """Where built kernels are kept: ``$WEIR_KERNEL_DIR``, else ``<state_dir>/kernels``."""
    return Path(os.environ.get("WEIR_KERNEL_DIR") or state_dir_from_env() / "kernels")


@functools.cache
def _load() -> bool:
    build_dir = kernel_dir() / _build_tag()
    library = build_dir / f"{NAME}.so"
    built = library.exists() and library.stat().st_mtime >= SOURCE.stat().st_mtime
    started = time.perf_counter()
    try:
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        build_dir.mkdir(parents=True, exist_ok=True)
        if not built:
            log.info("building the paged attention kernel into %s (once, tens of seconds)", build_dir)
        cpp_extension.load(
            name=NAME,
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
        )
    except Exception as exc:  # a missing compiler or a failed build leaves the reference path working
        reason = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
        log.warning(
            "paged attention kernel unavailable (%s); attention falls back to the reference gather + SDPA",
            reason[0],
        )
        log.debug("paged attention kernel build output:\n%s", exc)
        return False
    if not built:
        log.info("paged attention kernel built in %.1f s", time.perf_counter() - started)
    return True


def _build_tag() -> str:
    """Torch's version and a digest of this CPU's feature flags (the code is compiled with -march=native)."""
    flags = platform.processor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), flags)
    except OSError:
        pass
    digest = hashlib.blake2b(f"{platform.machine()} {flags}".encode(), digest_size=6).hexdigest()
    return f"torch-{torch.__version__}-{platform.machine()}-{digest}"


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` package's binary may not be on it."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@dataclass(frozen=True)
class KernelBatch:
    """A step's sequences as the kernel reads them (built once per step, used by every layer)."""

    block_tables: torch.Tensor  # [seqs, max_blocks] int32, each row padded with block 0 (never read)
    seqs: torch.Tensor  # [seqs, 3] int32: first row in the flat batch, query length, context length
    block_size: int

    @classmethod
    def from_batch(cls, batch: StepBatch, block_size: int) -> KernelBatch:
        """The kernel's view of ``batch`` (already validated by the attention plan)."""
        blocks = [-(-ctx // block_size) for ctx in batch.context_lens]
        width = max(blocks, default=0)
        tables = [
            block
            for table, count in zip(batch.block_tables, blocks, strict=True)
            for block in itertools.chain(table[:count], itertools.repeat(0, width - count))
        ]
        starts = itertools.accumulate(batch.query_lens, initial=0)
        seqs = [
            value
            for start, q_len, ctx in zip(starts, batch.query_lens, batch.context_lens, strict=False)
            for value in (start, q_len, ctx)
        ]
        count = len(blocks)
        return cls(
            block_tables=torch.tensor(tables, dtype=torch.int32).view(count, width),
            seqs=torch.tensor(seqs, dtype=torch.int32).view(count, 3),
            block_size=block_size,
        )

    def attend(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] for the step's queries ``q`` [T, heads, head_dim]."""
        return torch.ops.weir.paged_attention(
            q, key_cache, value_cache, self.block_tables, self.seqs, self.block_size, scale
        )
