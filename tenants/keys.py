"""API key material: ``wk-`` + 32 random bytes (URL-safe base64); stored only as SHA-256 and a prefix."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "wk-"
_SECRET_BYTES = 32
_SECRET_LENGTH = len(KEY_PREFIX) + len(secrets.token_urlsafe(_SECRET_BYTES))
_DISPLAY_LENGTH = 10


def new_secret() -> str:
    """A fresh API key secret."""
    return KEY_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)


def hash_secret(secret: str) -> bytes:
    """The SHA-256 digest stored for (and looked up by) a secret."""
    return hashlib.sha256(secret.encode("utf-8")).digest()


def secret_prefix(secret: str) -> str:
    """The short, non-secret display prefix kept with the key (``wk-`` and 7 characters)."""
    return secret[:_DISPLAY_LENGTH]


def well_formed(secret: str) -> bool:
    """Whether ``secret`` has the shape of a Weir key (checked before any lookup)."""
    return (
        isinstance(secret, str)
        and len(secret) == _SECRET_LENGTH
        and secret.startswith(KEY_PREFIX)
        and secret.isascii()
    )


def digest_matches(stored: bytes, secret: str) -> bool:
    """Constant-time comparison of a stored digest with a presented secret."""
    return hmac.compare_digest(bytes(stored), hash_secret(secret))
