"""``GET /metrics``: every metric in Prometheus' text format, for the admin token unless
``weir serve --metrics-public``."""

from __future__ import annotations

from litestar import Request, Response, get

from api.admin_api import require_admin_token
from api.telemetry import Telemetry

# Prometheus' classic text format, which generate_latest writes; Litestar adds "; charset=utf-8"
CONTENT_TYPE = "text/plain; version=0.0.4"


@get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    if not request.app.state.services.settings.metrics_public:
        require_admin_token(request)
    telemetry: Telemetry = request.app.state.telemetry
    return Response(telemetry.prometheus_text(), media_type=CONTENT_TYPE)
