"""How figures are written on the pages (the templates' filters). Counts and cost units are exact."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

COST_PLACES = Decimal("0.000001")  # the ledger keeps micro cost units


def count(value: int | None) -> str:
    """``1,234,567``; an em dash for none."""
    return "—" if value is None else f"{value:,}"


def cost(value: Decimal | float | None) -> str:
    """Cost units to the ledger's last digit, without trailing zeros: ``12,345.0625``."""
    if value is None:
        return "—"
    text = f"{Decimal(value).quantize(COST_PLACES):,f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def seconds(value: float | None) -> str:
    """A duration in ms below a second (``842 ms``), else in seconds (``3.25 s``)."""
    if value is None:
        return "—"
    return f"{value * 1000:,.0f} ms" if value < 1 else f"{value:,.2f} s"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def moment(value: datetime | None) -> str:
    """A UTC time to the second: ``2026-05-01 12:00:05``."""
    return "—" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def limit(value: float | int | None) -> str:
    """A quota limit; ``unlimited`` for none."""
    if value is None:
        return "unlimited"
    return f"{value:,}" if isinstance(value, int) or value != int(value) else f"{int(value):,}"


FILTERS = {
    "count": count,
    "cost": cost,
    "seconds": seconds,
    "percent": percent,
    "moment": moment,
    "limit": limit,
}
