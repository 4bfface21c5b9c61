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
    """Sessions by id, in memory, dropped after ``IDLE_TIMEOUT_S`` unused or ``LIFETIME_S`` in all."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def new(self, *, signed_in: bool) -> Session:
        now = self._clock()
        session = Session(secrets.token_urlsafe(32), secrets.token_urlsafe(32), signed_in, now, now)
        self._sessions[session.id] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session with that id, its idle clock restarted; ``None`` if unknown or expired."""
        session = self._sessions.get(session_id or "")
        if session is None:
            return None
        now = self._clock()
        if now - session.last_seen > IDLE_TIMEOUT_S or now - session.created > LIFETIME_S:
            del self._sessions[session.id]
            return None
        session.last_seen = now
        self._sessions.move_to_end(session.id)
        return session

    def drop(self, session_id: str | None) -> None:
        self._sessions.pop(session_id or "", None)


class SignInLimiter:
    """At most ``attempts`` failed sign-ins per client address in ``window_s``; then refused until the
    oldest failure is ``window_s`` old, whatever token is sent."""

    def __init__(self, attempts: int = 5, window_s: float = 300.0, clock=time.monotonic) -> None:
        self.attempts = attempts
        self.window_s = window_s
        self._clock = clock
        self._failures: dict[str, deque[float]] = {}

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
        if len(self._failures) > MAX_SESSIONS:
            for stale in [a for a in self._failures if not self._recent(a)]:
                self._failures.pop(stale, None)
        self._failures.setdefault(address, deque()).append(self._clock())
