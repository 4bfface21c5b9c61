"""The soak benchmark's tenants, made directly in the tenant store, and its audit of the usage ledger."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from tenants.admin import create_key, create_tenant
from tenants.db import create_engine
from tenants.models import usage_events
from tenants.records import Quotas

# A request reserves prompt + 2 x max_tokens cost units; in the soak's mix about one in ten reserves at
# most 100, so most of this tenant's requests are refused with 429 and a small one now and then is admitted.
OVER_QUOTA_COST_PER_MINUTE = 100.0
NORMAL_TENANTS = 2
# The soak looks for leaks, not latency: a loose TTFT target keeps admission control from shedding (503)
# the load the normal tenants are meant to carry.
NORMAL_TTFT_TARGET_S = 30.0
EXAMPLES = 5


@dataclass(frozen=True)
class SoakTenants:
    """The tenants a soak made: every id, one key per normal tenant, and the over-quota tenant's key."""

    ids: list[int]
    keys: list[str]
    over_quota_key: str


async def create_soak_tenants(database_url: str, ttft_target_s: float = NORMAL_TTFT_TARGET_S) -> SoakTenants:
    """``NORMAL_TENANTS`` tenants without limits and one limited to ``OVER_QUOTA_COST_PER_MINUTE``, a key
    each, under fresh names; all with a TTFT target of ``ttft_target_s``."""
    db = create_engine(database_url, poolclass=NullPool)
    tag = uuid.uuid4().hex[:8]
    try:
        ids, keys = [], []
        quotas = [Quotas()] * NORMAL_TENANTS + [Quotas(cost_per_minute=OVER_QUOTA_COST_PER_MINUTE)]
        names = [f"soak-{tag}-{i}" for i in range(NORMAL_TENANTS)] + [f"soak-{tag}-over-quota"]
        for name, quota in zip(names, quotas, strict=True):
            tenant = await create_tenant(db, name, ttft_target_s=ttft_target_s, quota=quota)
            _, secret = await create_key(db, tenant.id)
            ids.append(tenant.id)
            keys.append(secret)
    finally:
        await db.dispose()
    return SoakTenants(ids, keys[:-1], keys[-1])


def spilled_request_ids(spill_dir: Path) -> list[str]:
    """The request ids of the usage events a stopped server left in its spill files (``tenants.usage``):
    they reach the ledger only when a server starts again on the same state directory."""
    ids = []
    for path in sorted(spill_dir.glob("*.jsonl*")) if spill_dir.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                record = json.loads(line)
                if record.get("kind") == "usage":
                    ids.append(str(record["request_id"]))
    return ids


async def audit_ledger(
    database_url: str, tenant_ids: list[int], admitted: Iterable[str], spilled: Iterable[str] = ()
) -> dict:
    """Compare the tenants' usage events with the ids of the requests the server admitted: one row each.

    ``missing``: admitted requests without a row (``missing_spilled`` of them are in ``spilled``, the
    server's spill files); ``doubled``: rows beyond one per admitted request; ``extra``: rows of requests
    the client never saw admitted. Also the rows by status, and a few ids of each kind of mismatch.
    """
    db = create_engine(database_url, poolclass=NullPool)
    where = usage_events.c.tenant_id.in_(tenant_ids)
    try:
        async with db.connect() as conn:
            per_id = await conn.execute(
                sa.select(usage_events.c.request_id, sa.func.count())
                .where(where)
                .group_by(usage_events.c.request_id)
            )
            found = Counter({request_id: count for request_id, count in per_id})
            per_status = await conn.execute(
                sa.select(usage_events.c.status, sa.func.count()).where(where).group_by(usage_events.c.status)
            )
            by_status = dict(sorted((status, count) for status, count in per_status))
    finally:
        await db.dispose()
    wanted = Counter(admitted)
    missing = {rid: wanted[rid] - found[rid] for rid in wanted if wanted[rid] > found[rid]}
    doubled = {rid: found[rid] - wanted[rid] for rid in wanted if found[rid] > wanted[rid]}
    extra = {rid: found[rid] for rid in found if rid not in wanted}
    spilled = set(spilled)
    return {
        "spilled": len(spilled),
        "missing_spilled": sum(count for rid, count in missing.items() if rid in spilled),
        "admitted": sum(wanted.values()),
        "rows": sum(found.values()),
        "missing": sum(missing.values()),
        "doubled": sum(doubled.values()),
        "extra": sum(extra.values()),
        "rows_by_status": by_status,
        "examples": {
            name: sorted(ids)[:EXAMPLES]
            for name, ids in (("missing", missing), ("doubled", doubled), ("extra", extra))
            if ids
        },
    }
