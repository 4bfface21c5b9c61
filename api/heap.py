"""The process's startup heap, taken out of the garbage collector's view once serving begins.

Loading the model and importing torch, transformers, Litestar and SQLAlchemy leave about a million container
objects that live as long as the process. CPython's oldest-generation collection scans them all: on a
2-core machine that paused every thread (it holds the GIL) for 100-250 ms every few seconds under load,
which was the whole tail of refusal latency and part of TTFT's. ``gc.freeze()`` moves them to a permanent
generation that collections skip; objects made later are collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("weir.api")


def freeze_startup_heap() -> None:
    """Collect what startup left behind, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()
    log.info("froze %d startup objects out of garbage collection", gc.get_freeze_count())
