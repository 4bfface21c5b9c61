"""Signing in with the admin token, and out. A tenant's API key never signs in, whatever its value."""

from __future__ import annotations

import hmac
import logging
import math

from litestar import Request, Response, get, post
from litestar.params import QueryParameter
from litestar.response import Redirect

from dashboard.access import PREFIX, Dashboard, Refused, session_cookie
from tenants.keys import KEY_PREFIX

log = logging.getLogger("weir.dashboard")


def _safe_next(next_path: str | None) -> str:
    """Where to go after signing in: a dashboard path, never another site."""
    if (
        next_path
        and next_path.startswith(PREFIX)
        and not next_path.startswith("//")
        and "\\" not in next_path
    ):
        return next_path
    return PREFIX


@get(f"{PREFIX}/login")
async def login_form(
    request: Request, dash: Dashboard, next_path: str | None = QueryParameter(name="next", default=None)
) -> Response:
    session = dash.session_of(request)
    if session is not None and session.signed_in:
        return Redirect(_safe_next(next_path), status_code=303)
    session = session or dash.sessions.new(signed_in=False)
    form = dash.page(request, session, "login.html", next=_safe_next(next_path), error=None)
    return dash.with_cookie(form, request, session)


def _token_error(dash: Dashboard, token: str) -> str | None:
    """Why ``token`` does not sign in, or ``None`` when it is the admin token."""
    expected = dash.sources.admin_token
    if not expected:
        return "Signing in is off: the server has no admin token (set WEIR_ADMIN_TOKEN and restart it)."
    if token.startswith(KEY_PREFIX):
        return "That is a tenant's API key; only the admin token signs in here."
    if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), expected.encode()):
        return "That is not the admin token."
    return None


@post(f"{PREFIX}/login")
async def login(request: Request, dash: Dashboard) -> Response:
    session = dash.session_of(request)
    fields = await dash.form(request, session)
    assert session is not None  # dash.form refuses a post without one
    next_path = _safe_next(fields.get("next"))
    address = request.client.host if request.client else "unknown"
    wait_s = dash.limiter.retry_after_s(address)
    if wait_s > 0:
        log.warning("admin sign-in from %s refused: too many failed attempts", address)
        retry = str(math.ceil(wait_s))
        raise Refused(
            429, f"Too many failed sign-ins. Try again in {retry} s.", headers={"retry-after": retry}
        )
    error = _token_error(dash, fields.get("token", "").strip())
    if error is not None:
        dash.limiter.failed(address)
        log.warning("admin sign-in from %s failed: %s", address, error)
        return dash.page(request, session, "login.html", 401, next=next_path, error=error)
    dash.sessions.drop(session.id)
    signed_in = dash.sessions.new(signed_in=True)
    log.info("admin signed in from %s", address)
    return dash.with_cookie(Redirect(next_path, status_code=303), request, signed_in)


@post(f"{PREFIX}/logout")
async def logout(request: Request, dash: Dashboard) -> Response:
    session = dash.admin(request)
    await dash.form(request, session)
    dash.sessions.drop(session.id)
    response = Redirect(f"{PREFIX}/login", status_code=303)
    response.set_cookie(session_cookie(request, "", 0))
    return response
