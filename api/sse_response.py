"""The ASGI response that runs one admitted request through the engine and sends its answer.

Streamed requests get OpenAI's SSE framing; non-streamed ones one JSON body. Either way: a client that
disconnects aborts the engine request at once, a client that stops reading for ``client_timeout_s`` is
dropped, a request still running when the server's drain times out is cut (``api/drain.py``), and the
request is settled and metered exactly once in a shielded cleanup, however it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from api.drain import Drain
from api.errors import APIError
from api.metering import Job, Tracker
from api.openai_format import DONE, json_bytes, sse
from api.pool import BackendPool
from api.refusals import cut_at_shutdown
from api.settlement import Settlement
from engine.types import RequestOutput

if TYPE_CHECKING:
    from engine import AsyncEngine

log = logging.getLogger("weir.api")

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class ClientTooSlow(Exception):
    """The client did not read what was sent within the client timeout."""


class CompletionResponse:
    """ASGI app for one admitted completion request (``job``), streamed or not; it has entered ``drain``
    and leaves it once settled."""

    def __init__(
        self,
        job: Job,
        engine: AsyncEngine | BackendPool,
        settlement: Settlement,
        drain: Drain,
        client_timeout_s: float,
    ) -> None:
        self.job = job
        self.tracker = Tracker(job)
        self._engine = engine
        self._settlement = settlement
        self._drain = drain
        self._client_timeout_s = client_timeout_s
        self._cut = False  # the server's drain timed out and ended the request

    async def __call__(self, scope: dict, receive, send) -> None:
        self._settlement.begin(self.job)
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        try:
            if self.job.stream:
                await self._stream(send)
            else:
                await self._respond(send)
        except ClientTooSlow:
            self._drop()
        finally:
            watcher.cancel()
            try:
                await self._settlement.finish(self.job, self.tracker)
            finally:
                self._drain.leave(self.job.request_id)

    def cut(self) -> None:
        """End the request at the drain's timeout: the engine stops it within a step; its client gets the
        shutdown error after what was generated."""
        self._cut = True
        self._engine.abort(self.job.request_id)

    async def _watch_disconnect(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not self.tracker.responded:
                    self.tracker.disconnected = True
                    self._engine.abort(self.job.request_id)
                return

    def _drop(self) -> None:
        self.tracker.dropped = True
        self._engine.abort(self.job.request_id)
        log.warning(
            "dropped request %s of tenant %s: its client read nothing for %.1fs",
            self.job.request_id,
            self.job.tenant_name,
            self._client_timeout_s,
        )

    async def _send(self, send, message: dict) -> None:
        try:
            await asyncio.wait_for(send(message), self._client_timeout_s)
        except TimeoutError:
            raise ClientTooSlow from None

    async def _start(self, send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        headers = [*headers, (b"x-request-id", self.job.request_id.encode())]
        headers += [(name.encode(), value.encode()) for name, value in self.job.rate_limit_headers.items()]
        await self._send(send, {"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send, data: bytes, more: bool = True) -> None:
        await self._send(send, {"type": "http.response.body", "body": data, "more_body": more})

    async def _consume(self, emit: Callable[[RequestOutput], Awaitable[None]] | None = None) -> None:
        """Read the engine's deltas to the last one, handing each to ``emit`` while the client is there.

        A client that leaves or stalls has its request aborted; reading goes on until the engine's final
        delta (within a step), whose counts are what gets billed. Each delta is first held to the output
        the request has reserved (which it may extend while the client is there). Closing the iterator
        early (an error here) aborts the request in the engine too. A request the drain has already cut
        never reaches the engine.
        """
        if not self._drain.track(self.job.request_id, self.cut):
            self._cut = True
            self.tracker.update(RequestOutput(self.job.request_id, finished=True, finish_reason="abort"))
            return
        try:
            async with contextlib.aclosing(self._generate()) as outputs:
                async for delta in outputs:
                    out = await self._bounded(delta)
                    if out is None:
                        continue
                    self.tracker.update(out)
                    if self.tracker.gone or emit is None:
                        continue
                    try:
                        await emit(out)
                    except ClientTooSlow:
                        self._drop()
        except Exception as exc:  # the engine refused or failed: the client gets an error, the ledger a row
            log.exception("request %s failed in the engine", self.job.request_id)
            self.tracker.fail(str(exc))

    def _generate(self) -> AsyncIterator[RequestOutput]:
        job = self.job
        # a pool of backends also takes the prompt as sent, for the backends that take text
        source = {"source": job.source} if isinstance(self._engine, BackendPool) else {}
        return self._engine.generate(
            job.request_id,
            job.prompt_ids,
            job.params,
            tenant_id=str(job.tenant_id),
            priority=0,
            tpot_target_s=job.tpot_target_s,
            weight=job.weight,
            start_within_s=job.start_within_s,
            **source,
        )

    async def _bounded(self, delta: RequestOutput) -> RequestOutput | None:
        """``delta`` held to the output reserved, which grows first while the client is there; a delta cut
        short of the engine's end stops the engine request too."""
        allowance = self.job.output
        extra = 0 if self.tracker.gone else allowance.wanted(delta.output_tokens)
        if extra:
            allowance.grant(extra, await self._settlement.extend(self.job, extra))
        out = allowance.bound(delta, self._engine.tokenizer, self.job.prompt_ids)
        if out is not None and out.finished and not delta.finished:
            self._engine.abort(self.job.request_id)
        return out

    async def _stream(self, send) -> None:
        """The stream opens with the first text (or the end), so a request refused before it started
        gets a plain 503 rather than a 200 stream that carries an error."""
        shape = self.job.shape
        opened = False

        async def open_stream() -> None:
            nonlocal opened
            if not opened:
                opened = True
                await self._start(send, 200, _SSE_HEADERS)
                if shape.chat:
                    await self._body(send, sse(shape.chunk("", first=True)))

        async def emit(out: RequestOutput) -> None:
            completed = self.tracker.completed
            if out.text or completed:
                await open_stream()
                await self._body(
                    send, sse(shape.chunk(out.text, self.tracker.finish_reason if completed else None))
                )

        await self._consume(emit)
        if self.tracker.gone:
            return
        if self.tracker.refused or (self._cut and not opened and not self.tracker.completed):
            await self._answer(send, self._error())
            return
        await open_stream()
        if shape.include_usage:  # also ahead of an error event: what the client is billed for
            await self._body(send, sse(shape.usage_chunk(self.tracker.usage())))
        if not self.tracker.completed:  # failed after the stream started: an error event, then the end
            await self._body(send, sse(self._error().body()))
        self.tracker.responded = True
        await self._body(send, DONE, more=False)

    async def _respond(self, send) -> None:
        await self._consume()  # the answer is the tracker's merged text, sent once complete
        if self.tracker.gone:
            return
        if self.tracker.completed:
            body = self.job.shape.completion(
                self.tracker.total.text, self.tracker.finish_reason, self.tracker.usage()
            )
            await self._answer(send, None, body)
        else:
            await self._answer(send, self._error())

    def _error(self) -> APIError:
        """Why the request did not complete: the drain's cut, or the tracker's failure or refusal."""
        return cut_at_shutdown() if self._cut and not self.tracker.refused else self.tracker.error()

    async def _answer(self, send, error: APIError | None, body: dict | None = None) -> None:
        """The whole answer as one JSON body: ``body`` with 200, or ``error`` with its status and headers."""
        self.tracker.responded = True
        status, headers = 200, _JSON_HEADERS
        if error is not None:
            status, body = error.status, error.body()
            headers = [*headers, *((k.encode(), v.encode()) for k, v in error.headers.items())]
        await self._start(send, status, headers)
        await self._body(send, json_bytes(body), more=False)
