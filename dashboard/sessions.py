"""Server-side admin sessions, their CSRF tokens, and the limit on failed sign-ins.

A browser gets a session when it first opens the sign-in form: a random id in a cookie (HttpOnly,
SameSite=Strict, path ``/admin``, Secure over HTTPS) that names a record kept in this process. The record
holds the session's CSRF token, which every form carries as ``_csrf_token`` and every POST must return
unchanged. Signing in replaces the session with a new id (no fixation); signing out deletes it.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

COOKIE = "weir_admin_session"
CSRF_FIELD = "_csrf_token"
IDLE_TIMEOUT_S = 2 * 3600.0
LIFETIME_S = 12 * 3600.0
MAX_SESSIONS = 10_000  # the oldest are dropped beyond this (sign-in forms opened and never used)
MAX_ADDRESSES = 10_000  # addresses whose failed sign-ins are kept


@dataclass
class Session:
    id: str
    csrf_token: str
    signed_in: bool
    created: float
    last_seen: float = field(default=0.0)

    def csrf_matches(self, given: object) -> bool:
        """Whether a form's token is this session's (constant time; anything but text is wrong)."""
        return isinstance(given, str) and hmac.compare_digest(given.encode(), self.csrf_token.encode())


class SessionStore:
    """Sessions by id, in memory, dropped after ``IDLE_TIMEOUT_S`` unused or ``LIFETIME_S`` in all.

    Signed-in sessions and the anonymous ones of sign-in forms are kept apart, each to ``MAX_SESSIONS``
    (least recently used dropped first), so that opening the sign-in form many times can never push an
    admin's session out."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._signed_in: OrderedDict[str, Session] = OrderedDict()
        self._anonymous: OrderedDict[str, Session] = OrderedDict()

    def _kind(self, signed_in: bool) -> OrderedDict[str, Session]:
        return self._signed_in if signed_in else self._anonymous

    def new(self, *, signed_in: bool) -> Session:
        now = self._clock()
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), signed_in, now, now)
        sessions = self._kind(signed_in)
        sessions[session.id] = session
        while len(sessions) > MAX_SESSIONS:
            sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session with that id, its idle clock restarted; ``None`` if unknown or expired."""
        key = session_id or ""
        session = self._signed_in.get(key) or self._anonymous.get(key)
        if session is None:
            return None
        sessions = self._kind(session.signed_in)
        now = self._clock()
        if now - session.last_seen > IDLE_TIMEOUT_S or now - session.created > LIFETIME_S:
            del sessions[key]
            return None
        session.last_seen = now
        sessions.move_to_end(key)
        return session

    def drop(self, session_id: str | None) -> None:
        for sessions in (self._signed_in, self._anonymous):
            sessions.pop(session_id or "", None)


class SignInLimiter:
    """At most ``attempts`` failed sign-ins per client address in ``window_s``; then refused until the
    oldest failure is ``window_s`` old, whatever token is sent.

    The failures of at most ``MAX_ADDRESSES`` addresses are kept, ordered by their latest failure: those
    whose failures are all older than the window go first, then, when that is not enough, the addresses
    that failed longest ago."""

    def __init__(self, attempts: int = 5, window_s: float = 300.0, clock=time.monotonic) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str) -> deque[float]:
        failures = self._failures.get(address, deque())
        cutoff = self._clock() - self.window_s
        while failures and failures[0] <= cutoff:
            failures.popleft()
        if not failures:
            self._failures.pop(address, None)
        return failures

    def retry_after_s(self, address: str) -> float:
        """Seconds until ``address`` may try again; 0 when it may now."""
        failures = self._recent(address)
        if len(failures) < self.attempts:
            return 0.0
        return max(0.0, failures[0] + self.window_s - self._clock())

    def failed(self, address: str) -> None:
        now = self._clock()
        self._failures.setdefault(address, deque()).append(now)
        self._failures.move_to_end(address)
        cutoff = now - self.window_s
        while self._failures:
            oldest = next(iter(self._failures.values()))
            if oldest[-1] > cutoff and len(self._failures) <= MAX_ADDRESSES:
                break
            self._failures.popitem(last=False)
