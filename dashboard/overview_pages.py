"""The overview, the tenants table and the request ledger (list and one request)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from decimal import Decimal
from typing import Any
from urllib.parse import urlencode

from litestar import Request, get
from litestar.response import Template

from dashboard.access import PREFIX, Dashboard, Refused
from dashboard.ranges import Range
from tenants.admin import get_tenant, list_tenants
from tenants.reporting import LedgerFilter, TenantFigures, ledger_entry, ledger_page, overview, tenant_table

PAGE_SIZE = 50
STATUSES = ("ok", "cancelled", "error")
FINISH_REASONS = ("stop", "length", "abort", "client_timeout", "error", "deadline")


def _share(used: Decimal | int, limit: float | int | None) -> float | None:
    """``used`` as a share of ``limit``; ``None`` when unlimited."""
    return None if limit is None else float(used) / float(limit) if limit else 1.0


def quota_use(row: TenantFigures) -> dict[str, float | None]:
    """A tenant's use of each limit now: cost of the last minute, slots held, the month's spend."""
    return {
        "rate": _share(row.cost_last_minute, row.cost_per_minute),
        "concurrency": _share(row.slots_held, row.max_concurrency),
        "budget": _share(row.spent_this_month, row.monthly_budget),
    }


def _lowest_first(value: Any) -> tuple[bool, Any]:
    return (value is None, value)


SORTS: dict[str, Callable[[TenantFigures], Any]] = {
    "name": lambda t: t.name,
    "requests": lambda t: t.figures.requests,
    "prompt_tokens": lambda t: t.figures.prompt_tokens,
    "cached_tokens": lambda t: t.figures.cached_tokens,
    "output_tokens": lambda t: t.figures.output_tokens,
    "cost_units": lambda t: t.figures.cost_units,
    "slo": lambda t: t.figures.slo_attainment,
    "ttft_p99": lambda t: t.figures.ttft_p99,
    "tpot_p99": lambda t: t.figures.tpot_p99,
    "refused": lambda t: t.figures.refused,
    "rate_use": lambda t: quota_use(t)["rate"],
    "concurrency_use": lambda t: quota_use(t)["concurrency"],
    "budget_use": lambda t: quota_use(t)["budget"],
}


@get(PREFIX)
async def overview_page(
    request: Request,
    dash: Dashboard,
    selected: Range,
) -> Template:
    session = dash.admin(request)
    db = dash.sources.db()
    figures, tenants = await asyncio.gather(overview(db, selected.window), list_tenants(db))
    targets = {
        "ttft": sorted({t.ttft_target_s for t in tenants}),
        "tpot": sorted({t.tpot_target_s for t in tenants}),
    }
    return dash.page(
        request,
        session,
        "overview.html",
        range=selected,
        figures=figures,
        targets=targets,
        engine=dash.sources.engine_stats(),
    )


@get(f"{PREFIX}/tenants")
async def tenants_page(
    request: Request,
    dash: Dashboard,
    selected: Range,
    sort: str = "name",
    order: str | None = None,
) -> Template:
    session = dash.admin(request)
    if sort not in SORTS:
        raise Refused(400, f"sort must be one of {', '.join(SORTS)}, got {sort!r}")
    if order not in (None, "asc", "desc"):
        raise Refused(400, f"order must be asc or desc, got {order!r}")
    descending = order == "desc" if order else sort != "name"
    rows = await tenant_table(dash.sources.db(), selected.window)
    rows.sort(key=lambda row: _lowest_first(SORTS[sort](row)), reverse=descending)
    return dash.page(
        request,
        session,
        "tenants.html",
        range=selected,
        rows=[(row, quota_use(row)) for row in rows],
        sort=sort,
        descending=descending,
    )


def _key_id(text: str | None) -> int | None:
    if not text:
        return None
    if not (text.isascii() and text.isdigit() and len(text) < 19):
        raise Refused(400, f"key must be a key id (a number), got {text!r}")
    return int(text)


@get(f"{PREFIX}/requests")
async def requests_page(
    request: Request,
    dash: Dashboard,
    tenant: str | None = None,
    key: str | None = None,
    status: str | None = None,
    finish_reason: str | None = None,
    before: str | None = None,
) -> Template:
    session = dash.admin(request)
    db = dash.sources.db()
    tenant_id = (await get_tenant(db, tenant)).id if tenant else None
    filters = LedgerFilter(
        tenant_id=tenant_id, key_id=_key_id(key), status=status or None, finish_reason=finish_reason or None
    )
    rows, next_cursor = await ledger_page(db, filters, before or None, PAGE_SIZE)
    chosen = {"tenant": tenant, "key": key, "status": status, "finish_reason": finish_reason}
    chosen = {name: value for name, value in chosen.items() if value}
    next_url = f"{PREFIX}/requests?{urlencode({**chosen, 'before': next_cursor})}" if next_cursor else None
    return dash.page(
        request,
        session,
        "requests.html",
        rows=rows,
        chosen=chosen,
        next_url=next_url,
        first_url=f"{PREFIX}/requests?{urlencode(chosen)}" if before else None,
        tenants=await list_tenants(db),
        statuses=STATUSES,
        finish_reasons=FINISH_REASONS,
    )


@get(f"{PREFIX}/requests/{{request_id:str}}")
async def request_page(request: Request, dash: Dashboard, request_id: str) -> Template:
    session = dash.admin(request)
    entry = await ledger_entry(dash.sources.db(), request_id)
    if entry is None:
        raise Refused(404, f"No request {request_id!r} in the ledger.")
    return dash.page(request, session, "request.html", entry=entry)


ROUTES = [overview_page, tenants_page, requests_page, request_page]
