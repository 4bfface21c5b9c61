"""API key auth: ``Authorization: Bearer wk-...`` to its tenant, or a 401 in OpenAI's envelope."""

from __future__ import annotations

from api.errors import APIError
from tenants.auth import AuthError, KeyAuthenticator, Principal

_MESSAGES = {
    "unknown_key": "Incorrect API key provided. You can create keys with 'weir key create TENANT'.",
    "revoked_key": "This API key has been revoked.",
    "tenant_suspended": "The tenant of this API key is suspended.",
}


def unauthorized(message: str, code: str = "invalid_api_key") -> APIError:
    return APIError(401, message, code=code)


def bearer_token(header: str | None) -> str:
    """The secret from an ``Authorization`` header; 401 when it is missing or malformed."""
    if not header:
        raise unauthorized(
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code="missing_api_key",
        )
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token:
        raise unauthorized("Malformed Authorization header: expected 'Bearer YOUR_KEY'.")
    return token


async def authenticate(authenticator: KeyAuthenticator, header: str | None) -> Principal:
    """The caller's principal, or a 401 saying whether the key is missing, unknown, revoked or suspended."""
    token = bearer_token(header)
    try:
        return await authenticator.authenticate(token)
    except AuthError as exc:
        code = "invalid_api_key" if exc.reason == "unknown_key" else exc.reason
        raise unauthorized(_MESSAGES.get(exc.reason, str(exc)), code=code) from None
