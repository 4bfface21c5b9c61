"""Where a system's time goes: torch operator time versus everything else (Python, scheduling)."""

from __future__ import annotations

import time
from collections.abc import Callable

TOP_OPS = 12


def profile_run(run: Callable[[], object], top: int = TOP_OPS) -> dict:
    """Run ``run()`` once under the torch profiler (which slows it somewhat) and split its wall time.

    ``op_s`` is the self time of all torch operators; the rest of the wall time is Python and other work
    around them. ``top_ops`` lists the operators with the most self time.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    op_s = sum(e.self_cpu_time_total for e in events) / 1e6
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "wall_s": round(wall, 3),
        "op_s": round(op_s, 3),
        "outside_ops_s": round(max(0.0, wall - op_s), 3),
        "top_ops": [
            {"op": e.key, "self_s": round(e.self_cpu_time_total / 1e6, 3), "calls": e.count} for e in ranked
        ],
    }
