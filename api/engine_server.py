"""``weir engine``: one ``AsyncEngine`` behind the small HTTP streaming protocol of ``api/engine_wire.py``.

A plain ASGI app (no tenants, no database, no keys: it is meant to sit on a private network or a unix
socket behind ``weir serve``). A client that closes the connection while its request streams aborts the
engine request at once, so its KV blocks are free within one step.

On SIGTERM or SIGINT the engine drains (``api/drain.py``): ``/health`` answers 503 ``"draining"`` (a
gateway's pool takes the engine out of routing at its next probe), a new request gets a 503 (the pool sends
it elsewhere), and the requests it runs finish up to ``--drain-timeout``; those still running then end
with finish reason ``abort`` and the counts so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator

import msgspec

from api import engine_wire as wire
from api.drain import DRAIN_TIMEOUT_S, Drain
from api.heap import freeze_startup_heap
from engine.client import AsyncEngine
from engine.types import RequestOutput, SamplingParams

log = logging.getLogger("weir.engine")

_JSON = [(b"content-type", b"application/json")]
_NDJSON = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]


def _error(message: str, type_: str = "invalid_request_error", code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type_, "param": None, "code": code}})


class EngineApp:
    """The ASGI app over ``engine``; the engine starts and stops with the server's lifespan."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.ready = False
        self.drain = Drain()

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if not self.ready:
            await _reply(send, 503, _error("the engine is starting", "server_error", "not_ready"))
        elif (method, path) == ("POST", wire.GENERATE_PATH):
            if self.drain.draining:
                await _reply(send, 503, _error("the engine is shutting down", "server_error", "draining"))
            else:
                await self._generate(receive, send)
        elif (method, path) == ("GET", wire.HEALTH_PATH):
            health = self._health()
            await _reply(send, 503 if self.drain.draining else 200, msgspec.json.encode(health))
        elif (method, path) == ("GET", wire.STATS_PATH):
            await _reply(send, 200, wire.encode_stats(self.engine.stats()))
        else:
            await _reply(send, 404, _error(f"no route {method} {path}", code="not_found"))

    def _health(self) -> dict:
        engine = self.engine
        return {
            "status": "draining" if self.drain.draining else "ok",
            "model": engine.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "block_size": engine.config.block_size,
            "in_flight": self.drain.open,  # generate requests being read or streamed
        }

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.engine.start()
                except Exception as exc:
                    log.exception("the engine did not start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                freeze_startup_heap()
                self.ready = True
                log.info("engine ready: model %s", self.engine.model_name)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.ready = False
                await self.engine.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _generate(self, receive, send) -> None:
        self.drain.enter()
        request_id = None
        try:
            checked = await self._read_request(receive, send)
            if checked is not None:
                request_id = checked[0].request_id
                await self._serve(*checked, receive, send)
        finally:
            self.drain.leave(request_id)

    async def _read_request(self, receive, send) -> tuple[wire.GenerateRequest, SamplingParams] | None:
        """The request and its sampling parameters; None when the client left or the request is bad
        (answered 400)."""
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            request = wire.decode_request(body)
            params = request.sampling()
            self.engine.core.check_request(request.prompt_token_ids, params)
        except ValueError as exc:
            await _reply(send, 400, _error(str(exc)))
            return None
        return request, params

    async def _serve(self, request: wire.GenerateRequest, params: SamplingParams, receive, send) -> None:
        stream = asyncio.create_task(self._stream(request, params, send))
        watcher = asyncio.create_task(_until_disconnect(receive))
        await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not stream.done():  # the client went away: closing the generator aborts the engine request
            stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):  # OSError: a send after the client left
            await stream

    async def _stream(self, request: wire.GenerateRequest, params: SamplingParams, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _NDJSON})
        deltas = self._deltas(request, params)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                await send(
                    {"type": "http.response.body", "body": wire.encode_delta(delta), "more_body": True}
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _deltas(self, request: wire.GenerateRequest, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The engine's deltas of ``request``, cut by the drain should it time out (iterate at once: the
        cut aborts the request in the engine); only the end if the drain has already cut."""
        request_id = request.request_id
        if not self.drain.track(request_id, functools.partial(self.engine.abort, request_id)):
            return _ended(RequestOutput(request_id, finished=True, finish_reason="abort"))
        return self.engine.generate(
            request_id,
            request.prompt_token_ids,
            params,
            tenant_id=request.tenant,
            priority=request.priority,
            tpot_target_s=request.tpot_target_s,
            weight=request.weight,
            start_within_s=request.start_within_s,
        )


async def _ended(last: RequestOutput) -> AsyncIterator[RequestOutput]:
    yield last


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def private_unix_socket(path: str) -> socket.socket:
    """A unix socket bound at ``path`` that only this user may connect to: mode 0600 from its creation,
    never wider (the umask is narrowed around ``bind``, which runs before the engine's thread starts). A
    stale socket left at ``path`` is replaced; any other file there is an error."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(umask)
    return sock


def run_engine_server(
    engine: AsyncEngine,
    host: str,
    port: int | None,
    socket_path: str | None,
    log_level: str,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
) -> None:
    """Serve ``engine`` on ``host:port`` or on the unix socket ``socket_path`` (mode 0600: uvicorn would
    make it 0666, open to every local user) until interrupted."""
    import uvicorn

    from api.draining_server import DrainingServer

    listener = None
    if socket_path:
        try:
            listener = private_unix_socket(socket_path)
        except OSError as exc:
            raise SystemExit(f"weir engine: error: cannot listen on {socket_path}: {exc.strerror}") from None
    where = {"fd": listener.fileno()} if listener else {"host": host, "port": port}
    app = EngineApp(engine)
    config = uvicorn.Config(app, lifespan="on", log_level=log_level, timeout_graceful_shutdown=5, **where)
    server = DrainingServer(config, app.drain, drain_timeout_s)
    try:
        server.run()
    finally:
        if listener is not None:
            listener.close()
    if not server.started:
        raise SystemExit("weir engine: error: the server did not start (see the log above)")
