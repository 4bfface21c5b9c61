"""The serving process's startup heap is frozen out of garbage collection once it serves."""

from __future__ import annotations

import gc

from api.heap import freeze_startup_heap


def _collected(obj: object) -> bool:
    """Whether a collection of some generation would scan ``obj``."""
    return any(any(o is obj for o in gc.get_objects(generation)) for generation in range(3))


def test_objects_alive_at_startup_are_frozen_and_later_ones_are_not():
    survivor = [[] for _ in range(10)]
    assert _collected(survivor)
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0 and not _collected(survivor)
        later = [[] for _ in range(10)]
        assert _collected(later)  # what the process makes afterwards is collected as before
    finally:
        gc.unfreeze()
    assert _collected(survivor)
