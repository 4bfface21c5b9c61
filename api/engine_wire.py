"""The wire format of ``weir engine``: an engine request, its streamed deltas and the stats snapshot as JSON.

    POST /v1/engine/generate   body: a generate request (below)   ->  200, NDJSON: one delta a line
    GET  /health               {"status": "ok", "model", "max_model_len", "vocab_size", "block_size"}
    GET  /stats                the engine's ``EngineStats`` snapshot

A generate request is ``{"request_id", "prompt_token_ids", "params": {SamplingParams' fields}, "tenant",
"weight", "priority", "tpot_target_s", "start_within_s"}``. Each delta line holds what is new since the
previous one (``text``, ``token_ids``) and the cumulative counts (``prompt_tokens``, ``cached_tokens``,
``output_tokens``); the last has ``finished`` and ``finish_reason``. Times are durations (``queue_s``), never
clock readings, since the two processes' clocks differ. A refused request is a 4xx/5xx JSON body in
OpenAI's error envelope.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, TypeVar

import msgspec

from engine.types import EngineStats, RequestOutput, SamplingParams

GENERATE_PATH = "/v1/engine/generate"
HEALTH_PATH = "/health"
STATS_PATH = "/stats"

_encoder = msgspec.json.Encoder()
Count = Annotated[int, msgspec.Meta(ge=0)]
T = TypeVar("T")


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One engine request as the gateway sends it."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    tenant: str = "default"
    weight: float = 1.0
    priority: int = 0
    tpot_target_s: float | None = None
    start_within_s: float | None = None

    def sampling(self) -> SamplingParams:
        """The sampling parameters; ValueError for a field that is unknown or out of range."""
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(set(self.params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(unknown)}")
        try:
            return SamplingParams(**self.params)
        except TypeError as exc:
            raise ValueError(str(exc)) from None


def encode_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    tenant: str,
    weight: float,
    priority: int,
    tpot_target_s: float | None,
    start_within_s: float | None,
) -> bytes:
    request = GenerateRequest(
        request_id,
        list(prompt_token_ids),
        dataclasses.asdict(params),
        tenant,
        weight,
        priority,
        tpot_target_s,
        start_within_s,
    )
    return _encoder.encode(request)


def decode_request(body: bytes) -> GenerateRequest:
    """ValueError for a body that is not a generate request."""
    return _decode(body, GenerateRequest, "generate request")


def encode_delta(delta: RequestOutput) -> bytes:
    """One NDJSON line."""
    line = {
        "text": delta.text,
        "token_ids": delta.token_ids,
        "finished": delta.finished,
        "finish_reason": delta.finish_reason,
        "prompt_tokens": delta.prompt_tokens,
        "cached_tokens": delta.cached_tokens,
        "output_tokens": delta.output_tokens,
        "queue_s": delta.queue_time,
        "error": delta.error,
    }
    return _encoder.encode(line) + b"\n"


class _Delta(msgspec.Struct):
    """A delta line as the gateway reads it: every field, the right types, counts non-negative."""

    text: str
    token_ids: list[Count]
    finished: bool
    finish_reason: str | None
    prompt_tokens: Count
    cached_tokens: Count
    output_tokens: Count
    queue_s: Annotated[float, msgspec.Meta(ge=0)] | None
    error: str | None


class Health(msgspec.Struct):
    """What the gateway reads of ``GET /health``."""

    max_model_len: Annotated[int, msgspec.Meta(ge=1)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]


def decode_delta(request_id: str, line: bytes) -> RequestOutput:
    """A delta line as a ``RequestOutput`` (times are left to the receiver); ValueError for a line that is
    not one."""
    fields = msgspec.structs.asdict(_decode(line, _Delta, "delta"))
    fields["queue_time"] = fields.pop("queue_s")
    return RequestOutput(request_id, **fields)


def decode_health(body: bytes) -> Health:
    """ValueError for a body that is not a health answer."""
    return _decode(body, Health, "health answer")


def encode_stats(stats: EngineStats) -> bytes:
    return _encoder.encode(dataclasses.asdict(stats))


def decode_stats(body: bytes) -> EngineStats:
    """ValueError for a body that is not a stats snapshot; fields this gateway does not know (a newer
    engine's) are left out."""
    return _decode(body, EngineStats, "stats snapshot")


def _decode(body: bytes, kind: type[T], what: str) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:  # a ValidationError too
        raise ValueError(f"invalid {what}: {exc}") from None
