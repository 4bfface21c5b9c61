"""Admin JSON routes (bearer ``WEIR_ADMIN_TOKEN``): engine state, tenants' quotas and usage."""

from __future__ import annotations

import dataclasses
import hmac

from litestar import Request, get

from api.admin_report import tenants_overview
from api.errors import APIError
from api.services import Services


def require_admin_token(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer WEIR_ADMIN_TOKEN``."""
    services: Services = request.app.state.services
    header = request.headers.get("authorization") or ""
    scheme, _, token = header.partition(" ")
    expected = (services.settings.admin_token or "").encode()
    # compared as bytes: any header text (non-ASCII included) is a wrong token, never an error
    given = token.strip().encode("utf-8", "surrogateescape")
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
        raise APIError(
            401,
            "A valid admin token is required (Authorization: Bearer WEIR_ADMIN_TOKEN).",
            code="invalid_admin_token",
        )


def _services_as_admin(request: Request) -> Services:
    require_admin_token(request)
    services: Services = request.app.state.services
    services.check_ready()
    return services


@get("/admin/api/engine")
async def engine_state(request: Request) -> dict:
    services = _services_as_admin(request)
    stats = dataclasses.asdict(services.engine.stats())
    return {"model": services.model.name, **stats, "api": services.settlement.counters()}


@get("/admin/api/tenants")
async def tenants_state(request: Request) -> dict:
    services = _services_as_admin(request)
    return {"tenants": await tenants_overview(services.store.db, services.settlement.active_by_tenant)}


ADMIN_ROUTES = [engine_state, tenants_state]
