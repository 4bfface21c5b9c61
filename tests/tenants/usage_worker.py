"""A separate OS process that submits usage events (used by test_usage.py).

usage_worker.py URL SPILL_DIR FIRST COUNT -> submits events FIRST..FIRST+COUNT-1, flushes, prints
"flushed" with the number of events still only in memory, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from tenants.db import create_engine
from tenants.usage import UsageWriter
from tests.tenants.test_usage import make_event


async def main(url: str, spill_dir: str, first: int, count: int) -> None:
    engine = create_engine(url)
    writer = UsageWriter(engine, spill_dir=Path(spill_dir), flush_interval_s=0.01, retry_interval_s=0.05)
    for n in range(first, first + count):
        writer.submit(make_event(n))
    await writer.flush()
    print("flushed", writer.pending, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    url, spill, first, count = sys.argv[1:]
    asyncio.run(main(url, spill, int(first), int(count)))
