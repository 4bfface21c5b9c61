"""The dashboard's parts that need no server: sessions, the sign-in limit, ranges, figures' text, settings."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from dashboard.formatting import cost, seconds
from dashboard.ranges import BadRange, select_range
from dashboard.sessions import IDLE_TIMEOUT_S, LIFETIME_S, MAX_SESSIONS, SessionStore, SignInLimiter
from dashboard.tenant_page import parse_settings
from tenants.records import InvalidValue


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_expire_when_idle_and_at_their_lifetime() -> None:
    clock = Clock()
    store = SessionStore(clock)
    idle, busy = store.new(signed_in=True), store.new(signed_in=True)
    assert idle.id != busy.id and idle.csrf_token != busy.csrf_token
    for _ in range(int(LIFETIME_S // (IDLE_TIMEOUT_S / 2)) - 1):
        clock.now += IDLE_TIMEOUT_S / 2
        assert store.get(busy.id) is busy
    assert store.get(idle.id) is None
    clock.now = 1000.0 + LIFETIME_S + 1
    assert store.get(busy.id) is None
    assert store.get(None) is None and store.get("unknown") is None


def test_sign_in_forms_never_push_out_a_signed_in_session() -> None:
    store = SessionStore()
    admin = store.new(signed_in=True)
    forms = [store.new(signed_in=False) for _ in range(MAX_SESSIONS + 5)]
    assert store.get(admin.id) is admin
    assert store.get(forms[0].id) is None and store.get(forms[-1].id) is forms[-1]
    store.drop(admin.id)
    assert store.get(admin.id) is None


def test_csrf_tokens_compare_exactly() -> None:
    session = SessionStore().new(signed_in=False)
    assert session.csrf_matches(session.csrf_token)
    for wrong in (None, "", session.csrf_token[:-1], session.csrf_token + "x", 42):
        assert not session.csrf_matches(wrong)


def test_sign_ins_are_limited_per_address_within_the_window() -> None:
    clock = Clock()
    limiter = SignInLimiter(attempts=3, window_s=60, clock=clock)
    for _ in range(3):
        assert limiter.retry_after_s("10.0.0.1") == 0
        limiter.failed("10.0.0.1")
        clock.now += 10
    assert limiter.retry_after_s("10.0.0.1") == pytest.approx(30)
    assert limiter.retry_after_s("10.0.0.2") == 0
    clock.now += 30
    assert limiter.retry_after_s("10.0.0.1") == 0


def test_ranges() -> None:
    now = datetime(2026, 5, 10, 12, 30, tzinfo=UTC)
    day = select_range("24h", None, None, now)
    assert (day.window.since, day.window.until, day.step) == (now - timedelta(hours=24), now, "hour")
    assert select_range(None, None, None, now).name == "24h"
    month = select_range("30d", None, None, now)
    assert month.step == "day" and month.query() == "range=30d"
    custom = select_range(None, "2026-05-01", "2026-05-03T06:00", now)
    assert custom.name == "custom"
    assert custom.window.since == datetime(2026, 5, 1, tzinfo=UTC)
    assert custom.window.until == datetime(2026, 5, 3, 6, tzinfo=UTC)
    assert custom.query() == "range=custom&since=2026-05-01&until=2026-05-03T06%3A00%3A00"
    assert select_range("custom", "2026-05-01T02:00+02:00", None, now).window.since == datetime(
        2026, 5, 1, tzinfo=UTC
    )
    for args, message in (
        (("2d", None, None), "range must be one of"),
        (("custom", None, None), "needs since"),
        ((None, "soon", None), "since must be an ISO date"),
        ((None, "2026-05-02", "2026-05-01"), "must be after since"),
    ):
        with pytest.raises(BadRange, match=message):
            select_range(*args, now)


def test_figures_are_written_exactly() -> None:
    assert cost(Decimal("1234567.000001")) == "1,234,567.000001"
    assert cost(Decimal("38.600000")) == "38.6"
    assert cost(Decimal("0")) == "0"
    assert cost(None) == "—"
    assert seconds(0.0421) == "42 ms" and seconds(3.254) == "3.25 s" and seconds(None) == "—"


def test_settings_form_values() -> None:
    form = {
        "weight": "2",
        "ttft_target_s": "1.5",
        "tpot_target_s": " 0.1 ",
        "cost_per_minute": "",
        "max_concurrency": "8",
        "monthly_budget": "1e6",
        "max_output_tokens": "",
    }
    assert parse_settings(form) == {
        "weight": 2.0,
        "ttft_target_s": 1.5,
        "tpot_target_s": 0.1,
        "cost_per_minute": None,
        "max_concurrency": 8,
        "monthly_budget": 1e6,
        "max_output_tokens": None,
    }
    with pytest.raises(InvalidValue, match="Weight needs a number"):
        parse_settings({**form, "weight": ""})
    with pytest.raises(InvalidValue, match="Concurrent requests must be a whole number, got '2.5'"):
        parse_settings({**form, "max_concurrency": "2.5"})
