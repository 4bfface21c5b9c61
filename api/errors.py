"""OpenAI's error envelope for every refusal: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

log = logging.getLogger("weir.api")

_PARAM_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `([^`]+)`")


class APIError(Exception):
    """A refusal sent to the client as OpenAI's error envelope with its status and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        """The envelope as a JSON-ready dict (also sent as a mid-stream ``data:`` event)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_response(self) -> Response:
        return Response(
            self.body(), status_code=self.status, headers=self.headers, media_type="application/json"
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_decode_error(exc: msgspec.DecodeError) -> APIError:
    """A body that is not valid JSON, or valid JSON of the wrong shape, as a 400 naming the parameter."""
    text = str(exc)
    if isinstance(exc, msgspec.ValidationError):
        match = _PARAM_AT.search(text)
        param = match.group(1) or None if match else None
        message = _PARAM_AT.sub("", text)
        missing = _MISSING_FIELD.match(message)
        if missing:  # name the field itself, not the object that lacks it
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
            return bad_request(
                f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
            )
        if param:
            message = f"Invalid value for '{param}': {message}"
        return bad_request(message, param=param, code="invalid_value" if param else None)
    return bad_request(
        f"We could not parse the JSON body of your request ({text}). The body must be a JSON object.",
        code="invalid_json",
    )


_STATUS_DEFAULTS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
}


def _api_error_handler(_: Request, exc: APIError) -> Response:
    return exc.to_response()


def _http_exception_handler(request: Request, exc: HTTPException) -> Response:
    """Litestar's own refusals (unknown path, wrong method, body too large, ...) in the envelope."""
    status = exc.status_code
    if status >= 500:
        log.error("internal error on %s %s: %s", request.method, request.url.path, exc.detail)
        return APIError(
            status, "The server had an error while processing your request.", type="server_error"
        ).to_response()
    error_type, code = _STATUS_DEFAULTS.get(status, ("invalid_request_error", None))
    message = exc.detail or "Bad request"
    if status == 404:
        message = f"Unknown request URL: {request.method} {request.url.path}."
    elif status == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}."
    elif status == 413:
        message = "The request body is too large."
    return APIError(
        status, message, type=error_type, code=code, headers=dict(exc.headers or {})
    ).to_response()


def _unexpected_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(
        500, "The server had an error while processing your request.", type="server_error"
    ).to_response()


EXCEPTION_HANDLERS = {
    APIError: _api_error_handler,
    HTTPException: _http_exception_handler,
    Exception: _unexpected_handler,
}
