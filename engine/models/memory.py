"""Keep freed heap memory in the process instead of handing it back to the OS after every step.

A step allocates and frees the same large activations (gathered K/V, MLP intermediates) again and again. With
glibc's defaults, blocks that large are mmap-ed and unmapped each time, so every step pays a page fault per
4 KiB touched (about 100,000 faults for 32 decodes on SmolLM2). Raising the mmap threshold to its maximum and
disabling heap trimming makes them come back from the heap already mapped; the process keeps its peak heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's upper bound for M_MMAP_THRESHOLD on 64-bit
TRIM_NEVER = 2**31 - 1  # mallopt takes an int


def retain_freed_memory() -> bool:
    """Tune glibc's allocator for repeated large allocations; False where that is not possible (not glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    trimming_off = mallopt(M_TRIM_THRESHOLD, TRIM_NEVER)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(trimming_off)
