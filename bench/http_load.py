"""Open-loop load over HTTP: seeded Poisson arrivals of streamed OpenAI completions and multi-turn chats."""

from __future__ import annotations

import asyncio
import gc
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

    @property
    def requests(self) -> int:
        return 1


@dataclass(frozen=True)
class ChatSession:
    """A conversation of the load, opened at ``at``: each user turn is a streamed chat completion sent once
    the answer to the turn before has ended, with the whole conversation so far (the server's own answers
    included) after one system prompt."""

    at: float
    system: str
    user_turns: tuple[str, ...]
    max_tokens: tuple[int, ...]  # per turn
    api_key: str | None

    @property
    def requests(self) -> int:
        return len(self.user_turns)


def chat_messages(session: ChatSession, answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of turn ``len(answers)``: the system prompt, each earlier user turn followed by its
    answer, then this turn's user message."""
    messages = [{"role": "system", "content": session.system}]
    for user, answer in zip(session.user_turns, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": session.user_turns[len(answers)]})
    return messages


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
                record.done = time.perf_counter()
                record.refusal = _error_code(response)
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


def streamed_body(model: str, fields: dict, extra_body: dict | None = None) -> dict:
    """The JSON of a greedy streamed request with ``fields`` (prompt or messages, ``max_tokens``) that ends
    with a usage chunk; ``extra_body`` is added last."""
    return {
        "model": model,
        **fields,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra_body or {}),
    }


def _error_code(response: httpx.Response) -> str | None:
    """The ``error.code`` of an OpenAI error envelope, if the body is one."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _read_event(record: RequestRecord, event: dict) -> None:
    if "error" in event:
        record.error = str(event["error"])
        return
    for choice in event.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            record.chunk_times.append(time.perf_counter())
            record.text += text
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens", 0)
        record.prompt_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def run_load(
    base_url: str,
    model: str,
    load: Sequence[LoadRequest | ChatSession],
    extra_body: dict | None = None,
    on_done: Callable[[int, int], None] | None = None,
) -> list[RequestRecord]:
    """Send every request at its arrival time (open loop: nothing waits for earlier answers, except a
    conversation's next turn for the answer before it); one record per request, in the load's order.

    When a turn fails, the rest of its conversation is not sent and recorded as skipped. Everything alive
    before the load (the tokenizer, the libraries) is frozen out of garbage collection first: a full
    collection over it stalled this process 100-250 ms at a time, and every request in flight looked that
    much slower than the server made it.
    """
    gc.collect()
    gc.freeze()
    base = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(connect=30, read=600, write=30, pool=None)
    total = sum(item.requests for item in load)
    finished = 0

    def ended(count: int) -> None:
        nonlocal finished
        finished += count
        if on_done and count:
            on_done(finished, total)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def send(route: str, fields: dict, api_key: str | None) -> RequestRecord:
            record = await stream_completion(
                client, base + route, streamed_body(model, fields, extra_body), api_key
            )
            ended(1)
            return record

        async def converse(session: ChatSession) -> list[RequestRecord]:
            records: list[RequestRecord] = []
            for max_tokens in session.max_tokens:
                messages = chat_messages(session, [r.text for r in records])
                fields = {"messages": messages, "max_tokens": max_tokens}
                records.append(await send("/chat/completions", fields, session.api_key))
                if not records[-1].ok:
                    break
            skipped = [
                RequestRecord(sent=time.perf_counter(), skipped=True)
                for _ in range(len(records), session.requests)
            ]
            ended(len(skipped))
            return records + skipped

        async def one(item: LoadRequest | ChatSession) -> list[RequestRecord]:
            await asyncio.sleep(max(0.0, start + item.at - time.perf_counter()))
            if isinstance(item, ChatSession):
                return await converse(item)
            fields = {"prompt": item.prompt, "max_tokens": item.max_tokens}
            return [await send("/completions", fields, item.api_key)]

        start = time.perf_counter()
        results = await asyncio.gather(*(one(item) for item in load))
    return [record for records in results for record in records]


async def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id that ``GET {base_url}/models`` lists."""
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(base_url.rstrip("/") + "/models", headers=auth_headers(api_key))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/models lists no model")
    return models[0]["id"]
