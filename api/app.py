"""The Litestar application: ``create_app(settings)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar

from api.admin_api import ADMIN_ROUTES
from api.errors import EXCEPTION_HANDLERS
from api.openapi import openapi_json
from api.routes import ROUTES
from api.services import Services
from api.settings import Settings
from dashboard import DashboardSources, dashboard_router, template_config


def create_app(settings: Settings) -> Litestar:
    """The API over one engine and the tenant store; both start in the app's lifespan."""
    services = Services(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.services = services
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    dashboard = DashboardSources(
        database=lambda: services.store.db if services.ready else None,
        engine_stats=lambda: services.engine.stats() if services.ready else None,
        model_name=lambda: services.model.name,
        admin_token=settings.admin_token,
    )
    return Litestar(
        route_handlers=[*ROUTES, *ADMIN_ROUTES, openapi_json, dashboard_router(dashboard)],
        template_config=template_config(),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )
