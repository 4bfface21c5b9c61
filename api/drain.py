"""``Drain``: what a server does between a stop signal and its exit (``weir serve`` and ``weir engine``).

Draining, the server keeps listening but admits nothing new (its readiness answer turns 503, new requests
get a 503); the requests it had admitted run on, up to a timeout. Then the rest are cut: each request's
``cut`` callback ends it within an engine step, with an error its client can see, and it is settled as any
other. ``api/draining_server.py`` runs a drain on SIGTERM or SIGINT before it lets uvicorn shut down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger("weir.api")

DRAIN_TIMEOUT_S = 25.0  # the default: within Kubernetes' usual 30 s termination grace, with room to exit
CUT_WAIT_S = 2.0  # how long cut requests may take to send their end (one engine step, unless a client stalls)


def add_drain_option(parser: argparse.ArgumentParser) -> None:
    """``--drain-timeout SECONDS``, as ``weir serve`` and ``weir engine`` take it."""
    parser.add_argument(
        "--drain-timeout",
        type=_seconds,
        default=DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM or SIGINT, refuse new requests and let those admitted finish for this long, then "
        f"end the rest with an error (default {DRAIN_TIMEOUT_S:g})",
    )


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {text}")
    return value


class Drain:
    """The requests a server waits for before it exits, and how to cut each short."""

    def __init__(self) -> None:
        self.draining = False  # a stop signal came: admit nothing new
        self.cutting = False  # the drain timed out: requests still here are cut
        self._open = 0  # requests past the door and not yet ended
        self._cuts: dict[str, Callable[[], None]] = {}  # of those running, how to end each now
        self._changed = asyncio.Event()

    def enter(self) -> None:
        """A request passed the door (``draining`` was false); ``leave`` must follow, however it ends."""
        self._open += 1

    def track(self, request_id: str, cut: Callable[[], None]) -> bool:
        """Remember how to cut ``request_id`` (entered) should the drain time out; False when it already
        has: the caller then ends the request at once instead of starting it."""
        if self.cutting:
            return False
        self._cuts[request_id] = cut
        return True

    def leave(self, request_id: str | None = None) -> None:
        """An entered request ended (``request_id``: the one it tracked, if any)."""
        self._open -= 1
        if request_id is not None:
            self._cuts.pop(request_id, None)
        self._changed.set()

    @property
    def open(self) -> int:
        """Requests entered and not yet ended."""
        return self._open

    async def run(self, timeout_s: float) -> None:
        """Drain: refuse new requests, wait up to ``timeout_s`` for the open ones to end, then cut the rest
        and wait a little (``CUT_WAIT_S``) for them to send their end."""
        self.draining = True
        log.info("draining: %d requests in flight, new ones refused, %gs to finish", self._open, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                await self._until_closed()
            log.info("drained: every admitted request ended")
            return
        except TimeoutError:
            pass
        self.cut()
        try:
            async with asyncio.timeout(CUT_WAIT_S):
                await self._until_closed()
        except TimeoutError:
            log.warning("%d requests still open %gs after the drain cut them", self._open, CUT_WAIT_S)

    def cut(self) -> None:
        """End every running request now (and any that would start later)."""
        if not self.cutting:
            log.warning("drain: cutting %d requests short", len(self._cuts))
        self.cutting = True
        for cut in list(self._cuts.values()):
            cut()

    async def _until_closed(self) -> None:
        while self._open:
            self._changed.clear()
            await self._changed.wait()
