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
from typing import Any

import msgspec

from engine.types import EngineStats, RequestOutput, SamplingParams

GENERATE_PATH = "/v1/engine/generate"
HEALTH_PATH = "/health"
STATS_PATH = "/stats"

_encoder = msgspec.json.Encoder()


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
    try:
        return msgspec.json.decode(body, type=GenerateRequest)
    except msgspec.DecodeError as exc:
        raise ValueError(f"invalid generate request: {exc}") from None


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


def decode_delta(request_id: str, line: bytes) -> RequestOutput:
    """A delta line as a ``RequestOutput`` (times are left to the receiver)."""
    data = msgspec.json.decode(line)
    return RequestOutput(
        request_id,
        text=data["text"],
        token_ids=list(data["token_ids"]),
        finished=data["finished"],
        finish_reason=data["finish_reason"],
        prompt_tokens=data["prompt_tokens"],
        cached_tokens=data["cached_tokens"],
        output_tokens=data["output_tokens"],
        queue_time=data["queue_s"],
        error=data["error"],
    )


def encode_stats(stats: EngineStats) -> bytes:
    return _encoder.encode(dataclasses.asdict(stats))


def decode_stats(body: bytes) -> EngineStats:
    return EngineStats(**msgspec.json.decode(body))
