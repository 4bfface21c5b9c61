"""``weir engine``: one ``AsyncEngine`` behind the small HTTP streaming protocol of ``api/engine_wire.py``.

A plain ASGI app (no tenants, no database, no keys: it is meant to sit on a private network or a unix
socket behind ``weir serve``). A client that closes the connection while its request streams aborts the
engine request at once, so its KV blocks are free within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat

import msgspec

from api import engine_wire as wire
from api.heap import freeze_startup_heap
from engine.client import AsyncEngine

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
            await self._generate(receive, send)
        elif (method, path) == ("GET", wire.HEALTH_PATH):
            await _reply(send, 200, msgspec.json.encode(self._health()))
        elif (method, path) == ("GET", wire.STATS_PATH):
            await _reply(send, 200, wire.encode_stats(self.engine.stats()))
        else:
            await _reply(send, 404, _error(f"no route {method} {path}", code="not_found"))

    def _health(self) -> dict:
        engine = self.engine
        return {
            "status": "ok",
            "model": engine.model_name,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "block_size": engine.config.block_size,
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
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            request = wire.decode_request(body)
            params = request.sampling()
            self.engine.core.check_request(request.prompt_token_ids, params)
        except ValueError as exc:
            await _reply(send, 400, _error(str(exc)))
            return
        stream = asyncio.create_task(self._stream(request, params, send))
        watcher = asyncio.create_task(_until_disconnect(receive))
        await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not stream.done():  # the client went away: closing the generator aborts the engine request
            stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):  # OSError: a send after the client left
            await stream

    async def _stream(self, request: wire.GenerateRequest, params, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _NDJSON})
        deltas = self.engine.generate(
            request.request_id,
            request.prompt_token_ids,
            params,
            tenant_id=request.tenant,
            priority=request.priority,
            tpot_target_s=request.tpot_target_s,
            weight=request.weight,
            start_within_s=request.start_within_s,
        )
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                await send(
                    {"type": "http.response.body", "body": wire.encode_delta(delta), "more_body": True}
                )
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
    engine: AsyncEngine, host: str, port: int | None, socket_path: str | None, log_level: str
) -> None:
    """Serve ``engine`` on ``host:port`` or on the unix socket ``socket_path`` (mode 0600: uvicorn would
    make it 0666, open to every local user) until interrupted."""
    import uvicorn

    listener = None
    if socket_path:
        try:
            listener = private_unix_socket(socket_path)
        except OSError as exc:
            raise SystemExit(f"weir engine: error: cannot listen on {socket_path}: {exc.strerror}") from None
    where = {"fd": listener.fileno()} if listener else {"host": host, "port": port}
    config = uvicorn.Config(
        EngineApp(engine), lifespan="on", log_level=log_level, timeout_graceful_shutdown=5, **where
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        if listener is not None:
            listener.close()
    if not server.started:
        raise SystemExit("weir engine: error: the server did not start (see the log above)")
