"""What the admin JSON reports about tenants: quotas, this month's usage and refusals, requests in flight."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine as Database

from tenants.admin import list_tenants
from tenants.queries import DailyUsage, shed_counts, usage_by_day


def _totals(rows: list[DailyUsage]) -> dict[str, float]:
    """A tenant's usage summed over days and models."""
    return {
        "requests": sum(row.requests for row in rows),
        "errors": sum(row.errors for row in rows),
        "prompt_tokens": sum(row.prompt_tokens for row in rows),
        "cached_tokens": sum(row.cached_tokens for row in rows),
        "output_tokens": sum(row.output_tokens for row in rows),
        "cost": sum(row.cost for row in rows),
    }


async def tenants_overview(db: Database, active_by_tenant: Mapping[int, int]) -> list[dict]:
    """Every tenant with its quotas, this month's usage and refusals, and its requests in flight here."""
    month_start = datetime.now(UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    tenants, usage, shed = await asyncio.gather(
        list_tenants(db), usage_by_day(db, month_start), shed_counts(db, month_start)
    )
    days: dict[int, list[DailyUsage]] = {}
    for row in usage:
        days.setdefault(row.tenant_id, []).append(row)
    refusals: dict[int, dict[str, int]] = {}
    for row in shed:
        refusals.setdefault(row.tenant_id, {})[row.reason] = row.count
    return [
        {
            "id": t.id,
            "name": t.name,
            "status": t.status,
            "weight": t.weight,
            "ttft_target_s": t.ttft_target_s,
            "tpot_target_s": t.tpot_target_s,
            "quotas": dataclasses.asdict(t.quotas),
            "month": _totals(days[t.id]) if t.id in days else {},
            "refused": refusals.get(t.id, {}),
            "active_requests": active_by_tenant.get(t.id, 0),
        }
        for t in tenants
    ]
