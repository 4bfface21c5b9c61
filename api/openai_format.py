"""OpenAI's response shapes: completion objects, stream chunks, usage, rate-limit headers, and the SSE
framing."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import msgspec

from tenants.quotas import Allowance

_encoder = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def json_bytes(payload: dict) -> bytes:
    return _encoder.encode(payload)


def sse(payload: dict) -> bytes:
    """One Server-Sent Event in OpenAI's framing: ``data: {json}\\n\\n``."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def usage_dict(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def number_text(value: float) -> str:
    """A limit as text: whole numbers without decimals."""
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


def duration_text(seconds: float) -> str:
    """A duration as OpenAI writes them in rate-limit headers: ``250ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms" if seconds > 0 else "0s"
    minutes, rest = divmod(round(seconds, 3), 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limit_headers(allowance: Allowance) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers for what a tenant has left (docs/api.md, "Rate-limit headers"):
    requests are concurrency slots, tokens (and, by its own name, cost) the per-minute cost bucket; a
    limit the tenant does not have sends nothing."""
    headers = {}
    if (slots := allowance.concurrency) is not None:
        headers["x-ratelimit-limit-requests"] = number_text(slots.limit)
        headers["x-ratelimit-remaining-requests"] = str(int(slots.remaining))
        headers["x-ratelimit-reset-requests"] = "0s" if slots.remaining >= 1 else "1s"
    if (rate := allowance.rate) is not None:
        for unit in ("tokens", "cost"):
            headers[f"x-ratelimit-limit-{unit}"] = number_text(rate.limit)
            headers[f"x-ratelimit-remaining-{unit}"] = str(math.floor(rate.remaining))
            headers[f"x-ratelimit-reset-{unit}"] = duration_text(rate.reset_s or 0.0)
    return headers


@dataclass
class ResponseShape:
    """Builds one request's response objects: ``chat`` (chat.completion) or text (text_completion)."""

    id: str
    chat: bool
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        """A stream chunk with new text; the first one of a chat stream carries the role."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
            if finish_reason is not None and not text and not first:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            payload = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            payload = self._envelope("text_completion", [choice])
        if self.include_usage:
            payload["usage"] = None
        return payload

    def usage_chunk(self, usage: dict) -> dict:
        """The last chunk with ``include_usage``: no choices, the request's usage."""
        payload = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        payload["usage"] = usage
        return payload

    def completion(self, text: str, finish_reason: str | None, usage: dict) -> dict:
        """The whole non-streamed response."""
        if self.chat:
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            payload = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            payload = self._envelope("text_completion", [choice])
        payload["usage"] = usage
        return payload
