"""What the dashboard's figures must equal: sums straight over the ledger for a window and tenant."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from tenants.models import shed_events, tenants, usage_events
from tests.api.server import run_db


async def _totals(db: AsyncEngine, since: datetime, until: datetime, tenant_id: int | None) -> dict:
    u, s = usage_events.c, shed_events.c
    met = sa.and_(
        u.ttft_s <= tenants.c.ttft_target_s, sa.or_(u.tpot_s.is_(None), u.tpot_s <= tenants.c.tpot_target_s)
    )
    usage = (
        sa.select(
            sa.func.count().label("requests"),
            sa.func.coalesce(sa.func.sum(u.prompt_tokens), 0).label("prompt_tokens"),
            sa.func.coalesce(sa.func.sum(u.cached_tokens), 0).label("cached_tokens"),
            sa.func.coalesce(sa.func.sum(u.output_tokens), 0).label("output_tokens"),
            sa.func.coalesce(sa.func.sum(u.cost), 0).label("cost_units"),
            sa.func.count().filter(met).label("slo_met"),
        )
        .select_from(usage_events.outerjoin(tenants, tenants.c.id == u.tenant_id))
        .where(u.finished_at >= since, u.finished_at < until)
    )
    refused = sa.select(s.reason, sa.func.count()).where(s.at >= since, s.at < until).group_by(s.reason)
    if tenant_id is not None:
        usage = usage.where(u.tenant_id == tenant_id)
        refused = refused.where(s.tenant_id == tenant_id)
    async with db.connect() as conn:
        totals = dict((await conn.execute(usage)).one()._mapping)
        totals["refusals"] = {reason: n for reason, n in (await conn.execute(refused)).all()}
    totals["cost_units"] = Decimal(totals["cost_units"])
    return totals


def ledger_totals(url: str, since: datetime, until: datetime, tenant_id: int | None = None) -> dict:
    """Requests, token counts, exact cost, requests within targets and refusals by reason."""
    return run_db(url, _totals, since, until, tenant_id)
