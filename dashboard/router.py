"""The ``/admin`` router: the pages, their dependency on one :class:`Dashboard`, and HTML error pages."""

from __future__ import annotations

import logging
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Request, Response, Router
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.template.config import TemplateConfig

from dashboard import downloads, overview_pages, tenant_page
from dashboard.access import Dashboard, Refused, SignInRequired, sign_in_url
from dashboard.formatting import FILTERS
from dashboard.ranges import BadRange, range_from_query
from dashboard.signin import login, login_form, logout
from dashboard.sources import DashboardSources, Unavailable
from tenants.records import Conflict, InvalidValue, NotFound

log = logging.getLogger("weir.dashboard")
TEMPLATES = Path(__file__).parent / "templates"


def template_config() -> TemplateConfig:
    """Jinja2 over ``dashboard/templates`` with autoescaping and the figures' filters."""
    environment = Environment(
        loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(), auto_reload=False
    )
    environment.filters.update(FILTERS)
    return TemplateConfig(engine=JinjaTemplateEngine.from_environment(environment))


def dashboard_router(sources: DashboardSources) -> Router:
    """Every ``/admin`` page (the JSON under ``/admin/api`` is the application's)."""
    dash = Dashboard(sources)

    def error_page(
        request: Request, status: int, message: str, headers: dict[str, str] | None = None
    ) -> Template:
        session = dash.session_of(request)
        return dash.page(request, session, "error.html", status, headers, status_code=status, message=message)

    def refused(request: Request, exc: Refused) -> Response:
        return error_page(request, exc.status, exc.message, exc.headers)

    def sign_in_first(request: Request, exc: SignInRequired) -> Response:
        if request.method == "GET":
            return Redirect(sign_in_url(exc.path), status_code=303)
        return error_page(request, 403, "Sign in first: this form needs an admin session.")

    def known(status: int):
        def handler(request: Request, exc: Exception) -> Response:
            return error_page(request, status, str(exc))

        return handler

    def http_error(request: Request, exc: HTTPException) -> Response:
        if exc.status_code >= 500:
            log.error("dashboard error on %s %s: %s", request.method, request.url.path, exc.detail)
            return error_page(request, exc.status_code, "The server had an error showing this page.")
        return error_page(request, exc.status_code, exc.detail or "Bad request", dict(exc.headers or {}))

    def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("dashboard error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_page(request, 500, "The server had an error showing this page.")

    return Router(
        path="/",
        route_handlers=[
            login_form,
            login,
            logout,
            *overview_pages.ROUTES,
            *tenant_page.ROUTES,
            *downloads.ROUTES,
        ],
        dependencies={
            "dash": Provide(lambda: dash, sync_to_thread=False),
            "selected": Provide(range_from_query, sync_to_thread=False),
        },
        exception_handlers={
            Refused: refused,
            SignInRequired: sign_in_first,
            Unavailable: known(503),
            NotFound: known(404),
            InvalidValue: known(400),
            Conflict: known(409),
            BadRange: known(400),
            HTTPException: http_error,
            Exception: unexpected,
        },
        include_in_schema=False,
    )
