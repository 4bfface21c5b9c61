"""``DrainingServer``: uvicorn's server that drains (``api/drain.py``) on SIGTERM or SIGINT before it exits.

uvicorn's own handler stops listening at the signal and cuts whatever still runs after
``timeout_graceful_shutdown``, then re-raises the signal, so the process ends by it. Here the first signal
starts the drain while the server keeps listening (new requests are answered, with a 503); uvicorn's
shutdown begins only once the drain is over, and the process exits 0. A second signal cuts what is left at
once. A signal before the server has started stops it as uvicorn would, minus the re-raise.
"""

from __future__ import annotations

import asyncio
import socket
from types import FrameType

import uvicorn

from api.drain import CUT_WAIT_S, Drain


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose stop signals drain ``drain`` for up to ``timeout_s`` first."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        config.timeout_graceful_shutdown = round(CUT_WAIT_S)  # the drain has already waited for requests
        super().__init__(config)
        self._drain = drain
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or not self.started:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal)

    def _on_signal(self) -> None:
        if self._draining is None:
            self._draining = asyncio.create_task(self._drain_then_exit(), name="weir-drain")
        else:
            self._drain.cut()

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain.run(self._timeout_s)
        finally:
            self.should_exit = True
