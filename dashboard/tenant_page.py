"""One tenant: charts over the range, its keys (create, revoke) and its settings (weight, limits, targets)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template

from dashboard.access import PREFIX, Dashboard, Refused
from dashboard.charts import PALETTE, Series, chart
from dashboard.formatting import cost, seconds
from dashboard.ranges import Range, select_range
from dashboard.sessions import Session
from tenants.admin import create_key, get_tenant, list_keys, revoke_key, update_tenant
from tenants.models import SHED_REASONS
from tenants.records import InvalidValue, Tenant
from tenants.reporting import SeriesPoint, overview, tenant_series

log = logging.getLogger("weir.dashboard")

# the settings form: field -> (label, number type, whether empty means unlimited)
SETTINGS: dict[str, tuple[str, type, bool]] = {
    "weight": ("Weight", float, False),
    "ttft_target_s": ("TTFT target (s)", float, False),
    "tpot_target_s": ("TPOT target (s)", float, False),
    "cost_per_minute": ("Cost units per minute", float, True),
    "max_concurrency": ("Concurrent requests", int, True),
    "monthly_budget": ("Monthly budget (cost units)", float, True),
    "max_output_tokens": ("Output tokens per request", int, True),
}


def settings_values(tenant: Tenant) -> dict[str, Any]:
    """The form's current values from the tenant's record."""
    quotas = tenant.quotas
    return {
        name: getattr(quotas, name) if hasattr(quotas, name) else getattr(tenant, name) for name in SETTINGS
    }


def parse_settings(fields: dict[str, str]) -> dict[str, Any]:
    """The settings form's changes as numbers (an empty limit: unlimited); :class:`InvalidValue` if bad."""
    changes: dict[str, Any] = {}
    for name, (label, kind, may_be_empty) in SETTINGS.items():
        text = fields.get(name, "").strip()
        if not text:
            if not may_be_empty:
                raise InvalidValue(f"{label} needs a number")
            changes[name] = None
            continue
        try:
            changes[name] = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise InvalidValue(f"{label} must be {what}, got {text!r}") from None
    return changes


def charts(points: list[SeriesPoint], tenant: Tenant) -> dict[str, Any]:
    """The tenant's three charts over its intervals."""
    starts = [p.period_start for p in points]
    latency_colors = PALETTE[0], PALETTE[1]
    latency = {}
    for metric, target in (("ttft", tenant.ttft_target_s), ("tpot", tenant.tpot_target_s)):
        latency[metric] = chart(
            f"{metric.upper()} p50 and p99",
            starts,
            [
                Series(f"p{q}", [getattr(p, f"{metric}_p{q}") for p in points], color)
                for q, color in zip((50, 99), latency_colors, strict=True)
            ],
            bars=False,
            unit=seconds,
            target=target,
        )
    return {
        "cost": chart(
            "Cost units per interval",
            starts,
            [Series("cost units", [float(p.cost_units) for p in points], PALETTE[0])],
            bars=True,
            unit=lambda v: cost(round(v, 6)),
        ),
        "ttft": latency["ttft"],
        "tpot": latency["tpot"],
        "refusals": chart(
            "Refusals by reason",
            starts,
            [
                Series(reason, [p.refusals.get(reason, 0) for p in points], PALETTE[i % len(PALETTE)])
                for i, reason in enumerate(SHED_REASONS)
            ],
            bars=True,
            unit=lambda v: f"{v:,.0f}",
        ),
    }


async def _tenant_page(
    dash: Dashboard,
    request: Request,
    session: Session,
    name: str,
    selected: Range | None = None,
    status: int = 200,
    **extra: Any,
) -> Template:
    """The tenant's page over ``selected`` (default: the default range)."""
    selected = selected or select_range(None, None, None)
    db = dash.sources.db()
    tenant = await get_tenant(db, name)
    figures, points, keys = await asyncio.gather(
        overview(db, selected.window, tenant.id),
        tenant_series(db, tenant.id, selected.window, selected.step),
        list_keys(db, tenant.id),
    )
    context = {
        "range": selected,
        "tenant": tenant,
        "figures": figures,
        "charts": charts(points, tenant),
        "keys": sorted(keys, key=lambda k: k.id, reverse=True),
        "settings": SETTINGS,
        "values": settings_values(tenant),
        "new_secret": None,
        "settings_error": None,
        **extra,
    }
    return dash.page(request, session, "tenant.html", status=status, **context)


@get(f"{PREFIX}/tenants/{{name:str}}")
async def tenant_detail(
    request: Request,
    dash: Dashboard,
    name: str,
    selected: Range,
) -> Template:
    session = dash.admin(request)
    return await _tenant_page(dash, request, session, name, selected)


@post(f"{PREFIX}/tenants/{{name:str}}/keys", status_code=201)
async def create_tenant_key(request: Request, dash: Dashboard, name: str) -> Template:
    """A new key; the page shows its secret this once (it is not stored)."""
    session = dash.admin(request)
    await dash.form(request, session)
    key, secret = await create_key(dash.sources.db(), name)
    log.info("admin created key %s (%s) for tenant %s", key.id, key.prefix, name)
    return await _tenant_page(dash, request, session, name, status=201, new_secret=secret, new_key=key)


@post(f"{PREFIX}/tenants/{{name:str}}/keys/{{key_id:int}}/revoke")
async def revoke_tenant_key(request: Request, dash: Dashboard, name: str, key_id: int) -> Redirect:
    session = dash.admin(request)
    await dash.form(request, session)
    db = dash.sources.db()
    if key_id not in {key.id for key in await list_keys(db, name)}:
        raise Refused(404, f"Tenant {name!r} has no key {key_id}.")
    key = await revoke_key(db, key_id)
    log.info("admin revoked key %s (%s) of tenant %s", key.id, key.prefix, name)
    return Redirect(f"{PREFIX}/tenants/{name}", status_code=303)


@post(f"{PREFIX}/tenants/{{name:str}}/settings")
async def save_settings(request: Request, dash: Dashboard, name: str) -> Template | Redirect:
    session = dash.admin(request)
    fields = await dash.form(request, session)
    try:
        tenant = await update_tenant(dash.sources.db(), name, **parse_settings(fields))
    except InvalidValue as exc:
        values = {field: fields.get(field, "") for field in SETTINGS}
        return await _tenant_page(
            dash, request, session, name, status=400, values=values, settings_error=str(exc)
        )
    log.info("admin changed the settings of tenant %s", tenant.name)
    return Redirect(f"{PREFIX}/tenants/{tenant.name}", status_code=303)


ROUTES = [tenant_detail, create_tenant_key, revoke_tenant_key, save_settings]
