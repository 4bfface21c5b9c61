"""The soak benchmark's traffic: a seeded mix of requests, sent in a closed loop (capacity) or open loop.

Every request is one of five kinds, dealt by ``Mix`` in a seeded order, so that every 20 consecutive
requests hold each kind in the same numbers:

- ``stream``: a streamed completion or chat completion read to ``[DONE]``;
- ``json``: the same, not streamed;
- ``leave``: streamed, and the client closes the connection after 1-4 events (if the answer is longer);
- ``over_quota``: from the tenant whose per-minute cost limit is tiny, so most are refused with 429;
- ``invalid``: a parameter the API refuses with 400 (``n`` of 2, or more output than the context holds).

Each answered request yields an ``Outcome`` with its status and ``x-request-id`` (present on every
admitted request, absent on refusals): the ids are what the ledger is checked against. A non-streamed
request only gets its headers with the answer, so no client abandons one (its ledger row would have no
known id); clients leave only streams, after their headers arrived.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass

import httpx

from bench.http_load import auth_headers, poisson_arrivals
from bench.serve import prompt_text
from bench.workload import WorkloadSpec, make_workload, ordinary_token_ids

PROMPT_LEN = (16, 256)
OUTPUT_LEN = (8, 64)
PROMPT_POOL = 64  # distinct prompts drawn once and reused
TIMEOUT = httpx.Timeout(connect=30, read=300, write=30, pool=None)


@dataclass(frozen=True)
class Mix:
    """How many requests of each kind every ``size`` consecutive requests hold."""

    stream: int = 8
    json: int = 6
    leave: int = 3
    over_quota: int = 2
    invalid: int = 1

    @property
    def size(self) -> int:
        return sum(asdict(self).values())

    def deck(self) -> list[str]:
        """One of each request of a ``size`` run, by kind, in the order above."""
        return [kind for kind, count in asdict(self).items() for _ in range(count)]


@dataclass(frozen=True)
class Shot:
    """One request to send: its kind, route, body and key; ``leave_after`` events for a client that leaves."""

    kind: str
    path: str
    body: dict
    api_key: str
    leave_after: int | None = None


@dataclass
class Outcome:
    """What the client saw of one request."""

    kind: str
    status: int | None = None  # None: the connection failed
    request_id: str | None = None
    completed: bool = False  # the whole answer arrived
    left: bool = False  # the client closed the connection mid-stream
    retry_after_s: float | None = None  # a refusal's Retry-After
    error: str | None = None

    @property
    def summary(self) -> str:
        """What the client saw, in a few words: kind, status and how it ended."""
        ended = "left" if self.left else "done" if self.completed else self.error or "unfinished"
        return f"{self.kind} {self.status} {ended}"

    @property
    def refused(self) -> bool:
        """Turned away before it ran: a 4xx, or a 503 from admission control or the connection cap."""
        return self.status is not None and (400 <= self.status < 500 or self.status == 503)


@dataclass
class Tally:
    """Running counts of the outcomes, read by the sampler while the load runs."""

    sent: int = 0
    done: int = 0
    refused: int = 0
    left: int = 0
    failed: int = 0

    def add(self, outcome: Outcome) -> None:
        if outcome.left:
            self.left += 1
        elif outcome.completed:
            self.done += 1
        elif outcome.refused:
            self.refused += 1
        else:
            self.failed += 1

    @property
    def in_flight(self) -> int:
        return self.sent - self.done - self.refused - self.left - self.failed


class Traffic:
    """Deals ``Shot``s for ``model`` from a seeded pool of prompts made of the tokenizer's ordinary ids."""

    def __init__(
        self, tokenizer, model: str, keys: list[str], over_quota_key: str, mix: Mix, seed: int
    ) -> None:
        spec = WorkloadSpec(PROMPT_POOL, PROMPT_LEN, OUTPUT_LEN, seed=seed)
        self.prompts = [
            (prompt_text(tokenizer, list(r.prompt_ids)), r.output_len)
            for r in make_workload(spec, ordinary_token_ids(tokenizer))
        ]
        self.model, self.keys, self.over_quota_key, self.mix = model, keys, over_quota_key, mix
        self.rng = random.Random(seed)
        self.deck: list[str] = []

    def next(self) -> Shot:
        """The next request of the mix: ``mix.size`` requests in a shuffled order, then the next such run."""
        if not self.deck:
            self.deck = self.mix.deck()
            self.rng.shuffle(self.deck)
        return self.shot(self.deck.pop())

    def normal(self) -> Shot:
        """A streamed or non-streamed request of a normal tenant, in the mix's proportion."""
        return self.shot(self.rng.choices(("stream", "json"), (self.mix.stream, self.mix.json))[0])

    def shot(self, kind: str) -> Shot:
        """A request of ``kind``: a prompt of the pool, in a completion or chat completion."""
        text, max_tokens = self.rng.choice(self.prompts)
        key = self.over_quota_key if kind == "over_quota" else self.rng.choice(self.keys)
        stream = kind in ("stream", "leave") or (kind == "over_quota" and self.rng.random() < 0.5)
        body: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "invalid":
            body.update(self.rng.choice(({"n": 2}, {"max_tokens": 10**7})))
        leave_after = self.rng.randint(1, 4) if kind == "leave" else None
        if self.rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": text}]
            return Shot(kind, "/chat/completions", body, key, leave_after)
        return Shot(kind, "/completions", {**body, "prompt": text}, key, leave_after)


async def send(client: httpx.AsyncClient, base_url: str, shot: Shot, outcome: Outcome) -> None:
    """Send one request and read its answer (or leave mid-stream as ``shot`` says) into ``outcome``, which
    holds the status and request id as soon as the headers arrive."""
    url = base_url.rstrip("/") + shot.path
    try:
        async with client.stream("POST", url, json=shot.body, headers=auth_headers(shot.api_key)) as response:
            outcome.status = response.status_code
            outcome.request_id = response.headers.get("x-request-id")
            if "retry-after" in response.headers:
                outcome.retry_after_s = float(response.headers["retry-after"])
            if response.status_code != 200 or not shot.body["stream"]:
                body = json.loads(await response.aread())
                outcome.completed = response.status_code == 200 and bool(body.get("choices"))
                if "error" in body:
                    outcome.error = _message(body["error"])
                return
            await _read_stream(response, shot, outcome)
    except (httpx.HTTPError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"


async def _read_stream(response: httpx.Response, shot: Shot, outcome: Outcome) -> None:
    events = 0
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            outcome.completed = outcome.error is None
            return
        event = json.loads(data)
        if "error" in event:
            outcome.error = _message(event["error"])
        events += 1
        if shot.leave_after is not None and events >= shot.leave_after:
            outcome.left = True  # leaving the ``stream`` block closes the connection
            return
    outcome.error = outcome.error or "the stream ended without [DONE]"


def _message(error: dict) -> str:
    """An error envelope's code and message."""
    return f"{error.get('code')}: {error.get('message')}"


def _client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    return httpx.AsyncClient(limits=limits, timeout=TIMEOUT)


async def closed_loop(
    base_url: str, traffic: Traffic, clients: int, seconds: float, tally: Tally
) -> tuple[list[Outcome], float]:
    """``clients`` clients each sending normal requests one after another for ``seconds`` (each finishes
    the request it has started, and after a refusal waits its Retry-After, 1 s without one); the outcomes
    and the completed requests per second."""
    outcomes: list[Outcome] = []
    start = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() - start < seconds:
            shot = traffic.normal()
            outcome = Outcome(shot.kind)
            outcomes.append(outcome)
            tally.sent += 1
            await send(client, base_url, shot, outcome)
            tally.add(outcome)
            if outcome.status != 200:
                left_s = seconds - (time.monotonic() - start)
                await asyncio.sleep(max(0.0, min(outcome.retry_after_s or 1.0, left_s)))

    async with _client() as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    elapsed = time.monotonic() - start
    return outcomes, sum(o.completed for o in outcomes) / elapsed


async def open_loop(
    base_url: str,
    traffic: Traffic,
    rate: float,
    seconds: float,
    seed: int,
    tally: Tally,
    max_in_flight: int,
    drain_s: float,
) -> tuple[list[Outcome], dict]:
    """Send the mix at seeded Poisson arrivals of ``rate`` per second for ``seconds`` (open loop: nothing
    waits for earlier answers; an arrival finding ``max_in_flight`` requests unanswered is skipped), then
    wait up to ``drain_s`` for the answers and cancel what is left. The outcomes, and counts of skipped
    and cancelled requests."""
    expected = rate * seconds
    arrivals = [
        at for at in poisson_arrivals(int(expected + 10 * expected**0.5) + 10, rate, seed) if at < seconds
    ]
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task] = set()
    skipped = 0

    async def one(client: httpx.AsyncClient, shot: Shot, outcome: Outcome) -> None:
        try:
            await send(client, base_url, shot, outcome)
        except asyncio.CancelledError:
            outcome.error = "cancelled: no answer within the drain time"
            raise
        finally:
            tally.add(outcome)

    async with _client() as client:
        start = time.monotonic()
        for at in arrivals:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            shot = traffic.next()
            if len(tasks) >= max_in_flight:
                skipped += 1
                continue
            outcome = Outcome(shot.kind)
            outcomes.append(outcome)
            tally.sent += 1
            task = asyncio.create_task(one(client, shot, outcome))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(max(0.0, start + seconds - time.monotonic()))
        cancelled = 0
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=drain_s)
            for task in pending:
                task.cancel()
            cancelled = len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
    return outcomes, {"skipped": skipped, "cancelled": cancelled}
