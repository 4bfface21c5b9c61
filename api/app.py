"""The Litestar application: ``create_app(settings)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.datastructures import State
from litestar.plugins import PluginProtocol

from api.admin_api import ADMIN_ROUTES
from api.errors import EXCEPTION_HANDLERS
from api.metrics_route import metrics
from api.openapi import openapi_json
from api.routes import ROUTES
from api.services import Services
from api.settings import Settings
from api.telemetry import Telemetry
from dashboard import DashboardSources, dashboard_router, template_config


def create_app(settings: Settings) -> Litestar:
    """The API over one engine and the tenant store; both start in the app's lifespan."""
    services = Services(settings)
    telemetry = Telemetry(
        trace_ids=settings.log_format == "json",
        max_tenants=settings.metrics_max_tenants,
        served_model=lambda: services.model.name,
    )

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await services.start()
        telemetry.observe(services.engine.stats, services.store, settings.state_dir / "spill")
        try:
            yield
        finally:
            await services.stop()
            telemetry.shutdown()

    dashboard = DashboardSources(
        database=lambda: services.store.db if services.ready else None,
        engine_stats=lambda: services.engine.stats() if services.ready else None,
        model_name=lambda: services.model.name,
        admin_token=settings.admin_token,
    )
    return Litestar(
        route_handlers=[*ROUTES, *ADMIN_ROUTES, openapi_json, metrics, dashboard_router(dashboard)],
        template_config=template_config(),
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[lifespan],
        state=State({"services": services, "telemetry": telemetry}),  # the server drains services.drain
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        logging_config=None,
        plugins=_http_tracing(telemetry),
    )


def _http_tracing(telemetry: Telemetry) -> list[PluginProtocol]:
    """Litestar's OpenTelemetry plugin (the HTTP server span) when spans are made at all; its metrics keep
    only the attributes ``Telemetry``'s View lets through (no header, no path)."""
    if not telemetry.tracing:
        return []
    from litestar.plugins.opentelemetry import OpenTelemetryConfig, OpenTelemetryPlugin

    config = OpenTelemetryConfig(
        tracer_provider=telemetry.tracer_provider,
        meter_provider=telemetry.meter_provider,
        exclude_spans=["receive", "send"],  # one span per streamed chunk would cost more than it tells
    )
    return [OpenTelemetryPlugin(config)]
