"""Who may see the pages: the admin's session, the CSRF check on forms, and the pages' common context."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Request, Response
from litestar.datastructures import Cookie
from litestar.response import Template

from dashboard.sessions import COOKIE, CSRF_FIELD, LIFETIME_S, Session, SessionStore, SignInLimiter
from dashboard.sources import DashboardSources

PREFIX = "/admin"
NAV = (("Overview", PREFIX), ("Tenants", f"{PREFIX}/tenants"), ("Requests", f"{PREFIX}/requests"))
NAV += (("Exports", f"{PREFIX}/exports"),)
# No page may be shown in another site's frame (clickjacking): CSP for today's browsers, XFO for older ones
NO_FRAMES = {"content-security-policy": "frame-ancestors 'none'", "x-frame-options": "DENY"}


class Refused(Exception):
    """A request the dashboard answers with an error page: ``status`` and a message for the admin."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class SignInRequired(Exception):
    """No signed-in session: pages redirect to the sign-in form, form posts are refused."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


class Dashboard:
    """The sources, the sessions and the sign-in limiter of one process's dashboard."""

    def __init__(self, sources: DashboardSources) -> None:
        self.sources = sources
        self.sessions = SessionStore()
        self.limiter = SignInLimiter()

    def session_of(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE))

    def admin(self, request: Request) -> Session:
        """The signed-in session of the request, else :class:`SignInRequired`."""
        session = self.session_of(request)
        if session is None or not session.signed_in:
            raise SignInRequired(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
        return session

    async def form(self, request: Request, session: Session | None) -> dict[str, str]:
        """The posted form's fields, once its CSRF token is the session's; else a 403."""
        form = await request.form()
        fields = {name: value for name, value in form.items() if isinstance(value, str)}
        if session is None or not session.csrf_matches(fields.pop(CSRF_FIELD, None)):
            raise Refused(
                403, "The form's security token is missing or out of date. Reload the page and try again."
            )
        return fields

    def page(
        self,
        request: Request,
        session: Session | None,
        template: str,
        status: int = 200,
        headers: dict[str, str] | None = None,
        **context: Any,
    ) -> Template:
        """A dashboard page with the layout's context (navigation, CSRF field); never cached or framed."""
        return Template(
            template_name=template,
            context={**self.layout_context(request, session), **context},
            status_code=status,
            headers={"cache-control": "no-store", **NO_FRAMES, **(headers or {})},
        )

    def layout_context(self, request: Request, session: Session | None) -> dict[str, Any]:
        return {
            "nav": NAV,
            "path": request.url.path,
            "csrf_field": CSRF_FIELD,
            "csrf_token": session.csrf_token if session else "",
            "signed_in": bool(session and session.signed_in),
            "model_name": self.sources.model_name(),
        }

    def with_cookie(self, response: Response, request: Request, session: Session) -> Response:
        """``response`` setting the session cookie (Secure when the request came over HTTPS)."""
        response.set_cookie(session_cookie(request, session.id, int(LIFETIME_S)))
        return response


def session_cookie(request: Request, value: str, max_age: int) -> Cookie:
    return Cookie(
        key=COOKIE,
        value=value,
        path=PREFIX,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def sign_in_url(next_path: str) -> str:
    return f"{PREFIX}/login?next={quote(next_path, safe='/')}"
