"""Admin JSON routes (bearer ``WEIR_ADMIN_TOKEN``): engine state, tenants' quotas and usage."""

from __future__ import annotations

import dataclasses
import hmac

from litestar import Request, get

from api.errors import APIError
from api.runtime import Runtime


def require_admin_token(request: Request) -> None:
    """401 unless the request carries ``Authorization: Bearer WEIR_ADMIN_TOKEN``."""
    runtime: Runtime = request.app.state.runtime
    header = request.headers.get("authorization") or ""
    scheme, _, token = header.partition(" ")
    expected = (runtime.settings.admin_token or "").encode()
    # compared as bytes: any header text (non-ASCII included) is a wrong token, never an error
    given = token.strip().encode("utf-8", "surrogateescape")
    if not expected or scheme.lower() != "bearer" or not hmac.compare_digest(given, expected):
        raise APIError(
            401,
            "A valid admin token is required (Authorization: Bearer WEIR_ADMIN_TOKEN).",
            code="invalid_admin_token",
        )


def _runtime_as_admin(request: Request) -> Runtime:
    require_admin_token(request)
    runtime: Runtime = request.app.state.runtime
    runtime.check_ready()
    return runtime


@get("/admin/api/engine")
async def engine_state(request: Request) -> dict:
    runtime = _runtime_as_admin(request)
    stats = dataclasses.asdict(runtime.engine.stats())
    return {"model": runtime.model_name, **stats, "api": runtime.counters()}


@get("/admin/api/tenants")
async def tenants_state(request: Request) -> dict:
    runtime = _runtime_as_admin(request)
    return {"tenants": await runtime.tenants_overview()}


ADMIN_ROUTES = [engine_state, tenants_state]
