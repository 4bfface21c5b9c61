"""A separate OS process that reserves quota (used by test_quotas.py).

quota_worker.py URL burst TENANT_ID COUNT COST   -> prints the number granted
quota_worker.py URL hold TENANT_ID COUNT LEASE_S -> reserves COUNT, prints "holding", waits to be killed
"""

from __future__ import annotations

import asyncio
import sys

from tenants.db import create_engine
from tenants.quotas import QuotaManager, Reservation


async def main(url: str, mode: str, tenant_id: int, count: int, value: float) -> None:
    engine = create_engine(url)
    if mode == "burst":
        manager = QuotaManager(engine)
        results = await asyncio.gather(*(manager.reserve(tenant_id, value) for _ in range(count)))
        print(sum(isinstance(r, Reservation) for r in results), flush=True)
        await manager.close()
    else:
        manager = QuotaManager(engine, lease_s=value, sync_interval_s=value / 4)
        results = [await manager.reserve(tenant_id, 1.0) for _ in range(count)]
        assert all(isinstance(r, Reservation) for r in results), results
        print("holding", flush=True)
        await asyncio.Event().wait()
    await engine.dispose()


if __name__ == "__main__":
    url, mode, tenant, count, value = sys.argv[1:]
    asyncio.run(main(url, mode, int(tenant), int(count), float(value)))
