"""The range selector: the last 1 h / 24 h / 7 d / 30 d, or a custom UTC interval, as a reporting window."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from urllib.parse import urlencode

from litestar.params import QueryParameter

from tenants.reporting import MAX_SERIES_POINTS, Step, Window, series_length

SPANS = {
    "1h": timedelta(hours=1),
    "24h": timedelta(hours=24),
    "7d": timedelta(days=7),
    "30d": timedelta(days=30),
}
DEFAULT_SPAN = "24h"
HOURLY_UP_TO = timedelta(days=2)  # longer windows are charted per UTC day
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)  # the moments a range or an export may name
LATEST = datetime(2100, 1, 1, tzinfo=UTC)


class BadRange(ValueError):
    """A range the selector cannot use; the message says why."""


def parse_moment(name: str, text: str) -> datetime:
    """A UTC moment from an ISO date (its midnight) or an ISO time (without a zone: UTC), from
    ``EARLIEST`` to ``LATEST``."""
    moment: datetime | None
    try:
        if len(text) == 10:
            moment = datetime.combine(date.fromisoformat(text), datetime.min.time(), UTC)
        else:
            moment = datetime.fromisoformat(text)
            moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except ValueError:
        raise BadRange(
            f"{name} must be an ISO date (2026-05-01) or time (2026-05-01T12:00), got {text!r}"
        ) from None
    except OverflowError:  # a time in year 1 or 9999 whose offset takes it out of the calendar
        moment = None
    if moment is None or not EARLIEST <= moment <= LATEST:
        raise BadRange(f"{name} must be from {iso_text(EARLIEST)} to {iso_text(LATEST)} (UTC), got {text!r}")
    return moment


@dataclass(frozen=True)
class Range:
    """The selected range: its name (a span or ``custom``), the window it covers, and the chart step."""

    name: str
    window: Window

    @property
    def step(self) -> Step:
        return "hour" if self.window.until - self.window.since <= HOURLY_UP_TO else "day"

    def query(self) -> str:
        """The query string that selects this range again (for links)."""
        if self.name != "custom":
            return urlencode({"range": self.name})
        return urlencode(
            {"range": "custom", "since": iso_text(self.window.since), "until": iso_text(self.window.until)}
        )


def iso_text(moment: datetime) -> str:
    """``moment`` (UTC) as an ISO date when it is a midnight, else as an ISO time to the second."""
    if moment.time() == datetime.min.time():
        return moment.date().isoformat()
    return moment.strftime("%Y-%m-%dT%H:%M:%S")


def select_range(
    span: str | None, since: str | None, until: str | None, now: datetime | None = None
) -> Range:
    """The range from the selector's query (``range``, and ``since``/``until`` for a custom one).

    A ``since`` or ``until`` given without ``range`` means ``custom``; a custom range without ``until``
    ends now."""
    now = now or datetime.now(UTC)
    if span is None or span == "":
        span = "custom" if since or until else DEFAULT_SPAN
    if span in SPANS:
        return Range(span, Window.last(SPANS[span], now))
    if span != "custom":
        raise BadRange(f"range must be one of {', '.join([*SPANS, 'custom'])}, got {span!r}")
    if not since:
        raise BadRange("a custom range needs since (an ISO date or time, UTC)")
    start = parse_moment("since", since)
    end = parse_moment("until", until) if until else now
    if end <= start:
        raise BadRange(f"until ({iso_text(end)}) must be after since ({iso_text(start)})")
    selected = Range("custom", Window(start, end))
    points = series_length(selected.window, selected.step)
    if points > MAX_SERIES_POINTS:
        raise BadRange(
            f"a custom range may cover at most {MAX_SERIES_POINTS} UTC days (a chart point each); "
            f"{iso_text(start)} to {iso_text(end)} covers {points}"
        )
    return selected


def range_from_query(
    span: str | None = QueryParameter(name="range", default=None),
    since: str | None = None,
    until: str | None = None,
) -> Range:
    """The pages' ``selected`` dependency: the range their query selects."""
    return select_range(span, since, until)
