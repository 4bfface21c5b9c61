"""Plain value types handed out by ``tenants`` (no database objects escape the package)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, TypeVar


class TenantsError(Exception):
    """A user-facing failure in tenant or key administration; the message is one line."""


class NotFound(TenantsError, LookupError):
    """No tenant or key by that name or id."""


class Conflict(TenantsError):
    """The change collides with existing data (for example a duplicate tenant name)."""


class InvalidValue(TenantsError, ValueError):
    """A value is out of range or malformed."""


@dataclass(frozen=True)
class Quotas:
    """A tenant's limits; ``None`` means unlimited. Costs are cost units (engine/cost.py)."""

    cost_per_minute: float | None = None
    max_concurrency: int | None = None
    monthly_budget: float | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        check_positive("cost per minute", self.cost_per_minute)
        check_positive("max concurrency", self.max_concurrency, integer=True)
        check_positive("monthly budget", self.monthly_budget, allow_zero=True)
        check_positive("max output tokens", self.max_output_tokens, integer=True)


@dataclass(frozen=True)
class Tenant:
    id: int
    name: str
    weight: float
    status: str  # "active" | "suspended"
    ttft_target_s: float
    tpot_target_s: float
    quotas: Quotas
    created_at: datetime

    @property
    def active(self) -> bool:
        return self.status == "active"


@dataclass(frozen=True)
class ApiKey:
    """An API key's record; the secret itself is never stored, only its SHA-256 and a display prefix."""

    id: int
    tenant_id: int
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


_Record = TypeVar("_Record", "Quotas", "Tenant", "ApiKey")


def from_row(cls: type[_Record], row: Any, **given: Any) -> _Record:
    """A record built from the row's attributes of the same names (``given`` ones excepted)."""
    return cls(**{f.name: getattr(row, f.name) for f in fields(cls) if f.name not in given}, **given)


def check_positive(
    what: str, value: float | None, *, integer: bool = False, allow_zero: bool = False
) -> None:
    """Raise :class:`InvalidValue` unless ``value`` is ``None`` or a finite number above (or at) zero."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidValue(f"{what} must be a finite number, got {value!r}")
    if integer and int(value) != value:
        raise InvalidValue(f"{what} must be a whole number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "positive"
        raise InvalidValue(f"{what} must be {bound}, got {value!r}")
