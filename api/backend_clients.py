"""Clients of the two kinds of backend: a ``weir engine`` (token ids in, deltas with token ids and the
engine's counts out) and an OpenAI-compatible server (text or messages in, SSE chunks and its ``usage`` out).

Both stream a request as ``RequestOutput`` deltas (text, token ids where known, cumulative counts, the
finish reason) and leave the times to the pool. A backend that cannot be reached, answers 5xx, or breaks off
its stream raises ``BackendFailed``; a request the backend refuses as bad (4xx) ends with finish reason
``error`` and is not retried elsewhere.

What a backend sends is read with a size cap: ``stream_bytes(max_tokens)`` for a request's stream (more is
``BackendFailed``), ``BODY_BYTES`` for a probe's answer (more is a failed probe) and for an error body (more
is refused unread). Its counts are checked by the pool (``api/pool.py``), which holds them to what it saw.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import msgspec

from api import engine_wire as wire
from api.backends import BackendSpec, PromptSource
from engine.types import EngineStats, RequestOutput, SamplingParams

log = logging.getLogger("weir.api")

_TIMEOUT = httpx.Timeout(10.0, read=None)  # a stream may be silent while the backend queues the request
_LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=64)  # the window bounds the streams
_FINISH = {"stop": "stop", "length": "length", "eos": "stop", "tool_calls": "stop", "content_filter": "stop"}
STREAM_BYTES_BASE = 64 << 10  # bytes of a request's stream besides its tokens: framing, usage, keep-alives
STREAM_BYTES_PER_TOKEN = 2 << 10  # bytes per output token allowed (a token's chunk is a few hundred)
BODY_BYTES = 1 << 20  # a probe's answer or an error body


def stream_bytes(max_tokens: int) -> int:
    """The most bytes read from the stream of a request for ``max_tokens`` output tokens."""
    return STREAM_BYTES_BASE + STREAM_BYTES_PER_TOKEN * max_tokens


class BackendFailed(Exception):
    """The backend could not serve the request (unreachable, 5xx, or its stream broke off)."""


class _Refused(Exception):
    """The backend refused the request as bad (4xx); ``last`` is its final delta."""

    def __init__(self, last: RequestOutput) -> None:
        super().__init__(last.error)
        self.last = last


@dataclass
class Ticket:
    """One request as a backend receives it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    weight: float
    priority: int
    tpot_target_s: float | None
    start_within_s: float | None  # what is left of it after the wait in the gateway
    source: PromptSource | None


@dataclass(frozen=True)
class BackendInfo:
    """What a backend said about itself when it answered its probe."""

    max_model_len: int | None = None
    block_size: int | None = None
    stats: EngineStats | None = None  # a weir engine's snapshot


class Backend:
    """One backend's HTTP client."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        if spec.url.startswith("unix:"):
            transport = httpx.AsyncHTTPTransport(uds=spec.url.removeprefix("unix:"))
            self._http = httpx.AsyncClient(
                base_url="http://weir-engine", timeout=_TIMEOUT, limits=_LIMITS, transport=transport
            )
        else:
            self._http = httpx.AsyncClient(base_url=spec.url, timeout=_TIMEOUT, limits=_LIMITS)

    @property
    def name(self) -> str:
        return self.spec.name

    async def close(self) -> None:
        await self._http.aclose()

    async def probe(self) -> BackendInfo:
        """Check the backend answers; raises ``BackendFailed`` when it does not."""
        raise NotImplementedError

    def stream(self, ticket: Ticket) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    async def _get(self, path: str) -> bytes:
        """The body of a 200 answer to ``GET path`` (at most ``BODY_BYTES``), else ``BackendFailed``."""
        try:
            async with self._http.stream("GET", path, timeout=5.0) as response:
                if response.status_code != 200:
                    raise BackendFailed(f"{self.name}: GET {path} answered {response.status_code}")
                return await _read(response, BODY_BYTES, f"{self.name}: GET {path}")
        except httpx.HTTPError as exc:
            raise BackendFailed(f"{self.name}: {type(exc).__name__}: {exc}") from None

    async def _post_lines(self, ticket: Ticket, path: str, **body) -> AsyncIterator[str]:
        """POST and stream the answer's lines; a 4xx raises ``_Refused``, anything else that is not a
        whole 200 stream of at most ``stream_bytes(max_tokens)`` ``BackendFailed``."""
        try:
            async with self._http.stream("POST", path, **body) as response:
                if 400 <= response.status_code < 500:
                    raise _Refused(await _refused(ticket, response))
                if response.status_code != 200:
                    raise BackendFailed(f"{self.name} answered {response.status_code}")
                cap = stream_bytes(ticket.params.max_tokens)
                async for line in _lines(response, cap, f"{self.name}: the stream of {ticket.request_id}"):
                    yield line
        except httpx.HTTPError as exc:
            raise BackendFailed(f"{self.name}: {type(exc).__name__}: {exc}") from None


async def _read(response: httpx.Response, cap: int, what: str) -> bytes:
    """The answer's body; ``BackendFailed`` once it passes ``cap`` bytes (the rest is not read)."""
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > cap:
            raise BackendFailed(f"{what} passed {cap} bytes")
    return bytes(body)


async def _lines(response: httpx.Response, cap: int, what: str) -> AsyncIterator[str]:
    """The answer's lines (without their ends), each one only while the bytes up to its end are within
    ``cap``; ``BackendFailed`` at the first that is not (the rest is not read)."""
    buffer = bytearray()
    taken = 0  # bytes of the lines handed out
    async for chunk in response.aiter_bytes():
        start, searched = 0, len(buffer)  # the buffer holds no line end before ``searched``
        buffer += chunk
        while (end := buffer.find(b"\n", searched)) != -1 and taken + end + 1 - start <= cap:
            taken += end + 1 - start
            yield buffer[start:end].decode(errors="replace").removesuffix("\r")
            start = searched = end + 1
        del buffer[:start]
        if taken + len(buffer) > cap:
            raise BackendFailed(f"{what} passed {cap} bytes")
    if buffer:
        yield buffer.decode(errors="replace").removesuffix("\r")


async def _refused(ticket: Ticket, response: httpx.Response) -> RequestOutput:
    """The last delta of a request the backend refused as bad (not retried: another would refuse it too)."""
    try:
        body = await _read(response, BODY_BYTES, "the error body")
    except BackendFailed as exc:
        message = str(exc)
    else:
        try:
            message = str(msgspec.json.decode(body)["error"]["message"])[:500]
        except (msgspec.DecodeError, KeyError, TypeError):
            message = body.decode(errors="replace")[:500]
    return RequestOutput(
        ticket.request_id, finished=True, finish_reason="error", error=f"{response.status_code}: {message}"
    )


class WeirEngineBackend(Backend):
    """A ``weir engine`` process (``api/engine_server.py``)."""

    async def probe(self) -> BackendInfo:
        try:
            health = wire.decode_health(await self._get(wire.HEALTH_PATH))
            stats = wire.decode_stats(await self._get(wire.STATS_PATH))
        except ValueError as exc:
            raise BackendFailed(f"{self.name}: {exc}") from None
        return BackendInfo(health.max_model_len, health.block_size, stats)

    async def stream(self, ticket: Ticket) -> AsyncIterator[RequestOutput]:
        body = wire.encode_request(
            ticket.request_id,
            ticket.prompt_ids,
            ticket.params,
            ticket.tenant,
            ticket.weight,
            ticket.priority,
            ticket.tpot_target_s,
            ticket.start_within_s,
        )
        finished = False
        try:
            async for line in self._post_lines(ticket, wire.GENERATE_PATH, content=body):
                if line:
                    delta = wire.decode_delta(ticket.request_id, line.encode())
                    finished = delta.finished
                    yield delta
        except _Refused as refused:
            yield refused.last
            return
        except ValueError as exc:
            raise BackendFailed(f"{self.name}: {exc}") from None
        if not finished:
            raise BackendFailed(f"{self.name} ended the stream before the request finished")


class OpenAIBackend(Backend):
    """Any server speaking OpenAI's completions API with streaming and ``stream_options.include_usage``."""

    def __init__(self, spec: BackendSpec) -> None:
        super().__init__(spec)
        self.model = spec.model

    async def probe(self) -> BackendInfo:
        try:
            models = msgspec.json.decode(await self._get("/models"))
        except msgspec.DecodeError as exc:
            raise BackendFailed(f"{self.name}: /models is not JSON: {exc}") from None
        if self.model is None:
            try:
                self.model = str(models["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise BackendFailed(f"{self.name}: /models names no model") from None
        return BackendInfo(self.spec.max_model_len)

    def _body(self, ticket: Ticket) -> tuple[str, dict]:
        params, source = ticket.params, ticket.source or PromptSource(prompt=ticket.prompt_ids)
        body: dict = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if source.messages is not None:
            return "/chat/completions", {**body, "messages": source.messages}
        return "/completions", {**body, "prompt": source.prompt}

    async def stream(self, ticket: Ticket) -> AsyncIterator[RequestOutput]:
        """The text as it comes (the pool counts its tokens), then a last delta with the server's usage."""
        path, body = self._body(ticket)
        finish = None
        usage = None
        try:
            async for line in self._post_lines(ticket, path, json=body):
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = msgspec.json.decode(line[5:].strip())
                if "error" in chunk:
                    raise BackendFailed(f"{self.name} sent an error event: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                    if text:
                        yield RequestOutput(ticket.request_id, text=text)
        except _Refused as refused:
            yield refused.last
            return
        except msgspec.DecodeError as exc:
            raise BackendFailed(f"{self.name}: a chunk that is not JSON: {exc}") from None
        if finish is None:
            raise BackendFailed(f"{self.name} ended the stream without a finish reason")
        yield _last(ticket, finish, usage)


def _last(ticket: Ticket, finish: str, usage: object) -> RequestOutput:
    """The final delta with the backend's usage; a count it did not send as a non-negative integer is the
    gateway's own (its prompt count, no cached tokens, and the output the pool counted: 0 here)."""
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    return RequestOutput(
        ticket.request_id,
        finished=True,
        finish_reason=_FINISH.get(str(finish), "stop"),
        prompt_tokens=_count(usage.get("prompt_tokens")) or len(ticket.prompt_ids),
        cached_tokens=_count(details.get("cached_tokens")),
        output_tokens=_count(usage.get("completion_tokens")),
    )


def _count(value: object) -> int:
    """``value`` if it is a non-negative integer, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def make_backend(spec: BackendSpec) -> Backend:
    return WeirEngineBackend(spec) if spec.kind == "weir" else OpenAIBackend(spec)
