"""Open-loop load over HTTP: seeded Poisson arrivals of streamed OpenAI completions."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from bench.latency import RequestRecord


@dataclass(frozen=True)
class LoadRequest:
    """One request of the load: when it is sent (seconds after the start), what and with which key."""

    at: float
    prompt: str
    max_tokens: int
    api_key: str | None


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival offsets (seconds) of a Poisson process of ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    now, times = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict, api_key: str | None
) -> RequestRecord:
    """Send one streamed completion and time each chunk that carries text."""
    record = RequestRecord(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, headers=auth_headers(api_key)) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    _read_event(record, json.loads(data))
                except (ValueError, AttributeError) as exc:
                    record.error = f"malformed stream event {data[:80]!r}: {exc}"
                if record.error:
                    return record
            record.done = time.perf_counter()
            if not record.output_tokens:  # no usage chunk: count the text chunks
                record.output_tokens = len(record.chunk_times)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _read_event(record: RequestRecord, event: dict) -> None:
    if "error" in event:
        record.error = str(event["error"])
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            record.chunk_times.append(time.perf_counter())
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens", 0)
        record.prompt_tokens = usage.get("prompt_tokens")


async def run_load(
    base_url: str,
    model: str,
    load: Sequence[LoadRequest],
    extra_body: dict | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[RequestRecord]:
    """Send every request at its arrival time (open loop: nothing waits for earlier answers)."""
    url = base_url.rstrip("/") + "/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=30, read=600, write=30, pool=None)
    finished = 0

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(request: LoadRequest) -> RequestRecord:
            nonlocal finished
            await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": request.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
                **(extra_body or {}),
            }
            record = await stream_completion(client, url, body, request.api_key)
            finished += 1
            if on_done:
                on_done(finished, len(load))
            return record

        start = time.perf_counter()
        return list(await asyncio.gather(*(one(r) for r in load)))


async def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id that ``GET {base_url}/models`` lists."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/models", headers=auth_headers(api_key))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/models lists no model")
    return models[0]["id"]
