"""``BackendPool``: the gateway's fair queue in front of remote backends, with the engine's interface.

``weir serve --backend``/``--backends`` serves through a pool instead of an engine of its own. The pool
answers what the API asks an engine (``generate``, ``abort``, ``stats``, ``estimate_ttft``, the tokenizer
and the context length), so admission, streaming, settlement and metering are the same code for both.

- **One fair queue.** A request waits in the gateway, in the order of a ``FairSharePolicy`` (the engine's
  own, used through its public hooks): its tenant's served cost over its weight, plus the cost already sent
  to backends and not yet served. It is sent to a backend only while that backend's window of outstanding
  work has room (``api/pool_window.py``), so the backends' own queues stay short and the order that matters
  is the gateway's, even in front of servers that are first come, first served.
- **Routing.** Among the healthy backends with room, the one with the least outstanding cost; the backend
  that last took a request of the same tenant with the same prompt prefix (its KV blocks are there) when its
  outstanding cost is within one request's cost of the least.
- **Health.** Every backend is probed every ``probe_interval_s``; one that fails a probe (no answer, or one
  that cannot be read) or a request is taken out and comes back when a probe succeeds.
- **Counts.** A backend's counts are held to what the gateway saw (``_counts``): the prompt is the gateway's
  own count once the request produced output (never more before), the output never fewer than the tokens
  passed on, and a claim above those counts up to ``max_tokens``. An OpenAI-compatible server's text is
  counted in tokens with the gateway's tokenizer, chunk by chunk, so the output allowance holds it to the
  reservation however many tokens a chunk carries.
- **Failures.** A request whose backend fails before its first token went out is sent again to another
  backend (it keeps its place: it is first in the queue). After the first token it ends with finish reason
  ``error`` and the counts of what was sent (the API ends the stream with an error event and bills that);
  it is never restarted, since the client already holds part of an answer.
- **Deadlines.** A request still in the gateway queue when its start deadline (the tenant's TTFT target
  plus the grace) passes ends unstarted (``deadline``), as in the engine: refused, never served late.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from api.backend_clients import Backend, BackendFailed, BackendInfo, Ticket, make_backend
from api.backends import PoolConfig, PromptSource
from api.pool_window import Window
from engine.config import EngineConfig
from engine.cost import CostWeights, worst_case_cost
from engine.policies import FairSharePolicy
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from engine.types import EngineStats, RequestOutput, SamplingParams, TTFTEstimate

log = logging.getLogger("weir.api")

PREFIX_LENGTHS = (256, 128, 64, 32, 16)  # prompt prefixes (tokens) remembered for affinity, longest first
AFFINITY_ENTRIES = 10_000
RATE_WINDOW_S = 10.0  # served cost over this long gives the pool's service rate
START_TIMEOUT_S = 300.0  # how long start() waits for a first backend to answer


@dataclass(eq=False)
class _Member:
    backend: Backend
    window: Window
    healthy: bool = False
    outstanding: float = 0.0  # cost still to run of the requests sent to it
    inflight: int = 0
    info: BackendInfo = field(default_factory=BackendInfo)


@dataclass(eq=False)
class _Pending:
    """One request in the gateway, from ``generate`` to its last delta."""

    seq: Sequence  # what the fair policy sees
    source: PromptSource | None
    tpot_target_s: float | None
    ttft_target_s: float | None
    deadline: float | None  # time.monotonic() after which it is refused unstarted
    cost: float  # prefill and decode cost of the whole request (no prompt token cached)
    remaining: float  # of it, what is still to run
    deltas: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    member: _Member | None = None
    task: asyncio.Task | None = None
    tried: set[int] = field(default_factory=set)  # members that failed it before its first token
    dispatched_at: float = 0.0
    queue_time: float | None = None
    first_token_time: float | None = None
    last: RequestOutput | None = None  # the latest delta (cumulative counts)
    streamed: int = 0  # output token ids passed on
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def started(self) -> bool:
        return self.first_token_time is not None

    @property
    def output_sent(self) -> int:
        return self.last.output_tokens if self.last else 0


class BackendPool:
    """Remote backends behind one fair queue, used by the API as it uses an ``AsyncEngine``."""

    def __init__(
        self, config: PoolConfig, engine: EngineConfig, weights: CostWeights, deadline_grace_s: float
    ) -> None:
        self.config = engine  # the gateway's model (tokenizer, chat template, context)
        self._pool = config
        self._weights = weights
        self._grace_s = deadline_grace_s
        self.policy = FairSharePolicy(weights)
        self._members = [
            _Member(make_backend(spec), Window(config.initial_window, config.max_window))
            for spec in config.backends
        ]
        self._waiting: list[_Pending] = []
        self._requests: dict[str, _Pending] = {}
        self._affinity: OrderedDict[int, _Member] = OrderedDict()
        self._served: deque[tuple[float, int, int, float]] = deque()  # (time, prompt, output, cost)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._tokenizer: Tokenizer | None = None
        self.model_name = Path(engine.model or "model").name
        self.max_model_len = 0
        self.vocab_size = 0

    # -- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the tokenizer, wait for a first backend to answer, and start dispatching and probing."""
        model_dir = Path(self.config.model or ".")
        self._tokenizer = await asyncio.to_thread(Tokenizer, model_dir)
        shape = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = shape["vocab_size"]
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            await asyncio.gather(*(self._probe(m) for m in self._members))
            if any(m.healthy for m in self._members):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"no backend answered within {START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(self._pool.probe_interval_s)
        contexts = [m.info.max_model_len for m in self._members if m.info.max_model_len]
        self.max_model_len = min(contexts or [shape.get("max_position_embeddings", 2048)])
        self._tasks = [asyncio.create_task(self._dispatch_loop()), asyncio.create_task(self._probe_loop())]

    async def stop(self) -> None:
        """Stop dispatching; requests in flight end with finish reason "abort"."""
        for task in self._tasks:
            task.cancel()
        for request_id in list(self._requests):
            self.abort(request_id)
        running = [p.task for p in self._requests.values() if p.task is not None]
        await asyncio.gather(*self._tasks, *running, return_exceptions=True)
        await asyncio.gather(*(m.backend.close() for m in self._members))

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise RuntimeError("the pool is not started")
        return self._tokenizer

    # -- the engine's interface -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant_id: str = "default",
        priority: int = 0,
        tpot_target_s: float | None = None,
        weight: float = 1.0,
        start_within_s: float | None = None,
        source: PromptSource | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas as ``AsyncEngine.generate`` does; ``source`` is the prompt as the client
        sent it, for backends that take text."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the pool")
        now = time.monotonic()
        seq = Sequence(request_id, list(prompt_token_ids), params, tenant_id, priority, weight, now)
        cost = worst_case_cost(len(prompt_token_ids), params.max_tokens, self._weights)
        pending = _Pending(
            seq,
            source,
            tpot_target_s,
            None if start_within_s is None else max(0.0, start_within_s - self._grace_s),
            None if start_within_s is None else now + start_within_s,
            cost,
            cost,
        )
        self._requests[request_id] = pending
        self.policy.on_arrival(seq)
        self._waiting.append(pending)
        self._wake.set()
        finished = False
        try:
            while not finished:
                delta = await pending.deltas.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request: taken out of the queue, or its backend stream closed (the backend aborts it)."""
        pending = self._requests.get(request_id)
        if pending is None or pending.done:
            return
        if pending.task is not None:
            pending.task.cancel()
        else:
            self._waiting.remove(pending)
            self._finish(pending, self._last(pending, "abort"))

    def stats(self) -> EngineStats:
        """The pool as one engine: the gateway's queue, the requests at backends, the sum of the weir
        engines' memory and steps (as last probed); OpenAI-compatible servers report none."""
        engines = [m.info.stats for m in self._members if m.healthy and m.info.stats is not None]
        sizes = [m.info.block_size for m in self._members if m.info.block_size]
        prompt_rate, output_rate, _ = self._rates()
        return EngineStats(
            running=sum(m.inflight for m in self._members),
            waiting=len(self._waiting),
            kv_blocks_total=sum(s.kv_blocks_total for s in engines),
            kv_blocks_free=sum(s.kv_blocks_free for s in engines),
            block_size=sizes[0] if sizes else self.config.block_size,
            tokens_per_s=output_rate,
            prompt_tokens_per_s=prompt_rate,
            steps=sum(s.steps for s in engines),
            preemptions=sum(s.preemptions for s in engines),
            kv_blocks_cached=sum(s.kv_blocks_cached for s in engines),
            waiting_by_tenant=dict(Counter(p.seq.tenant_id for p in self._waiting)),
            step_seconds=sum(s.step_seconds for s in engines),
        )

    def cached_prefix_tokens(self, prompt_ids: list[int], tenant_id: str = "default") -> int:
        """0: the gateway does not see its backends' prefix caches."""
        return 0

    def estimate_ttft(
        self, prompt_tokens: int, tenant_id: str = "default", weight: float = 1.0
    ) -> TTFTEstimate:
        """A new request's time to first token: the cost the fair order serves from the gateway queue before
        it, at the pool's recent service rate, plus the backends' recent time from dispatch to first token.
        Reliable once the pool has served for a while and seen first tokens."""
        prefill = self._weights.prefill
        queued: Counter[str] = Counter()
        for pending in self._waiting:
            queued[pending.seq.tenant_id] += math.ceil(pending.remaining / prefill)
        _, _, rate = self._rates()
        ttfts = [m.window.ttft_s for m in self._members if m.healthy and m.window.ttft_s is not None]
        backend_s = min(ttfts) if ttfts else 0.0
        share = self.policy.share_ratio(tenant_id, weight)
        ahead = self.policy.tokens_ahead(queued, tenant_id, prompt_tokens, weight)
        if not rate:
            return TTFTEstimate(backend_s, ahead, False, share)
        # as in the engine: a second pass adds what others send within the first pass's wait
        ahead = self.policy.tokens_ahead(queued, tenant_id, prompt_tokens, weight, ahead * prefill / rate)
        return TTFTEstimate(ahead * prefill / rate + backend_s, ahead, bool(ttfts), share)

    # -- dispatch ---------------------------------------------------------------------------------------

    async def _dispatch_loop(self) -> None:
        while True:
            self._wake.clear()
            timeout = self._dispatch()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _dispatch(self) -> float | None:
        """Refuse what waited past its deadline, send what fits in the fair order; the seconds until the
        next deadline (None: none)."""
        now = time.monotonic()
        for pending in [p for p in self._waiting if p.deadline is not None and p.deadline <= now]:
            self._waiting.remove(pending)
            self._finish(pending, self._last(pending, "deadline"))
        while self._waiting:
            seq = self.policy.pick_next([p.seq for p in self._waiting], self._planned())
            pending = self._requests[seq.request_id]
            member = self._route(pending)
            if member is None:
                break
            self._waiting.remove(pending)
            self._send(pending, member)
        deadlines = [p.deadline for p in self._waiting if p.deadline is not None]
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _planned(self) -> dict[str, int]:
        """Per tenant, the cost sent to backends and not yet served, in prefill tokens."""
        planned: Counter[str] = Counter()
        for pending in self._requests.values():
            if pending.member is not None:
                planned[pending.seq.tenant_id] += math.ceil(pending.remaining / self._weights.prefill)
        return planned

    def _route(self, pending: _Pending) -> _Member | None:
        """The healthy backend with room and the least outstanding cost, or the one holding the prompt's
        prefix when it is within one request's cost of that."""
        open_ = [
            m
            for i, m in enumerate(self._members)
            if m.healthy and i not in pending.tried and m.window.has_room(m.outstanding, pending.remaining)
        ]
        if not open_:
            return None
        least = min(open_, key=lambda m: (m.outstanding, m.inflight))
        for key in self._prefix_keys(pending.seq):
            home = self._affinity.get(key)
            if home is not None:
                if home in open_ and home.outstanding - least.outstanding <= pending.remaining:
                    return home
                break
        return least

    def _prefix_keys(self, seq: Sequence) -> list[int]:
        prompt = seq.prompt_token_ids
        return [hash((seq.tenant_id, tuple(prompt[:n]))) for n in PREFIX_LENGTHS if len(prompt) >= n]

    def _send(self, pending: _Pending, member: _Member) -> None:
        for key in self._prefix_keys(pending.seq):
            self._affinity[key] = member
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_ENTRIES:
            self._affinity.popitem(last=False)
        log.debug(
            "request %s of tenant %s to %s (outstanding %.0f, %d waiting)",
            pending.request_id,
            pending.seq.tenant_id,
            member.backend.name,
            member.outstanding,
            len(self._waiting),
        )
        pending.member = member
        pending.dispatched_at = time.monotonic()
        member.outstanding += pending.remaining
        member.inflight += 1
        pending.task = asyncio.create_task(self._run(pending, member), name=f"pool-{pending.request_id}")

    async def _run(self, pending: _Pending, member: _Member) -> None:
        seq = pending.seq
        waited = time.monotonic() - seq.arrival_time
        left = None if pending.deadline is None else max(0.0, pending.deadline - time.monotonic())
        ticket = Ticket(
            seq.request_id,
            seq.prompt_token_ids,
            seq.params,
            seq.tenant_id,
            seq.weight,
            seq.priority,
            pending.tpot_target_s,
            left,
            pending.source,
        )
        pending.queue_time = waited
        try:
            async with contextlib.aclosing(member.backend.stream(ticket)) as deltas:
                async for delta in deltas:
                    self._on_delta(pending, member, delta)
        except BackendFailed as exc:
            self._on_failure(pending, member, exc)
        except Exception as exc:  # a backend answer this code cannot read is that backend's failure
            log.exception("request %s: unreadable answer from %s", pending.request_id, member.backend.name)
            self._on_failure(pending, member, BackendFailed(f"{member.backend.name}: {exc}"))
        except asyncio.CancelledError:
            self._finish(pending, self._last(pending, "abort"))

    def _on_delta(self, pending: _Pending, member: _Member, delta: RequestOutput) -> None:
        now = time.monotonic()
        ids = delta.token_ids
        if member.backend.spec.kind == "openai":  # text alone: its tokens as the gateway tokenizes it
            ids = self.tokenizer.encode_output(delta.text)
        prompt, cached, output = self._counts(pending, delta, len(ids))
        new = output - pending.output_sent
        if new and not pending.started:
            pending.first_token_time = now
            if delta.queue_time is not None:
                pending.queue_time = (pending.queue_time or 0.0) + delta.queue_time
            member.window.observe_first_token(
                now - pending.dispatched_at, pending.ttft_target_s, pending.cost
            )
            self.policy.on_tokens(pending.seq, prompt - cached, 0, cached)
            self._served_cost(pending, prompt, 0, self._weights.prefill * len(pending.seq.prompt_token_ids))
        if new:
            self.policy.on_tokens(pending.seq, 0, new, 0)
            self._served_cost(pending, 0, new, self._weights.decode * new)
        out = RequestOutput(
            pending.request_id,
            text=delta.text,
            token_ids=ids,
            token_times=[now] * new,
            finished=delta.finished,
            finish_reason=delta.finish_reason,
            prompt_tokens=prompt,
            cached_tokens=cached,
            output_tokens=output,
            arrival_time=pending.seq.arrival_time,
            queue_time=pending.queue_time,
            first_token_time=pending.first_token_time,
            error=delta.error,
        )
        pending.last = out
        if not delta.finished:
            pending.deltas.put_nowait(out)
            return
        if pending.started and out.output_tokens > 1:
            tpot = (now - pending.first_token_time) / (out.output_tokens - 1)
            member.window.observe_tpot(tpot, pending.tpot_target_s)
        self._finish(pending, out)

    def _counts(self, pending: _Pending, delta: RequestOutput, new_ids: int) -> tuple[int, int, int]:
        """The delta's prompt, cached and output counts, whatever the backend sent: the output is the token
        ids passed on, or the count before, or the backend's if higher up to ``max_tokens`` (ids beyond
        that are cut by the output allowance); the prompt is the gateway's own count once there is output,
        at most that before; the cached tokens are within the prompt."""
        pending.streamed += new_ids
        claimed = min(delta.output_tokens, pending.seq.params.max_tokens)
        output = max(pending.streamed, pending.output_sent, claimed)
        own = len(pending.seq.prompt_token_ids)
        prompt = own if output else min(own, delta.prompt_tokens)
        return prompt, min(delta.cached_tokens, prompt), output

    def _served_cost(self, pending: _Pending, prompt: int, output: int, cost: float) -> None:
        """Count what a backend served: off the request's outstanding cost, into the pool's rate."""
        cost = min(cost, pending.remaining)
        pending.remaining -= cost
        if pending.member is not None:
            pending.member.outstanding = max(0.0, pending.member.outstanding - cost)
        now = time.monotonic()
        self._served.append((now, prompt, output, cost))
        while self._served and self._served[0][0] < now - RATE_WINDOW_S:
            self._served.popleft()
        self._wake.set()

    def _rates(self) -> tuple[float, float, float]:
        """Prompt tokens, output tokens and cost served per second over the recent window."""
        now = time.monotonic()
        while self._served and self._served[0][0] < now - RATE_WINDOW_S:
            self._served.popleft()
        if not self._served:
            return 0.0, 0.0, 0.0
        span = max(1.0, now - self._served[0][0])
        return (
            sum(s[1] for s in self._served) / span,
            sum(s[2] for s in self._served) / span,
            sum(s[3] for s in self._served) / span,
        )

    def _on_failure(self, pending: _Pending, member: _Member, exc: BackendFailed) -> None:
        self._take_out(member, str(exc))
        if not pending.started:  # nothing reached the client: another backend serves it from the start
            log.warning("request %s moves to another backend: %s", pending.request_id, exc)
            self._release(pending)
            pending.task = None
            pending.tried.add(self._members.index(member))
            self._waiting.insert(0, pending)
            self._wake.set()
            return
        last = self._last(pending, "error")
        last.error = f"the backend failed after the answer had started ({exc})"
        self._finish(pending, last)

    def _take_out(self, member: _Member, why: str) -> None:
        if member.healthy:
            member.healthy = False
            log.warning("backend %s taken out: %s", member.backend.name, why)

    def _last(self, pending: _Pending, reason: str) -> RequestOutput:
        """A final delta with the counts so far and no new tokens."""
        last = pending.last or RequestOutput(pending.request_id)
        return RequestOutput(
            pending.request_id,
            finished=True,
            finish_reason=reason,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            output_tokens=last.output_tokens,
            arrival_time=pending.seq.arrival_time,
            queue_time=pending.queue_time,
            first_token_time=pending.first_token_time,
        )

    def _release(self, pending: _Pending) -> None:
        member, pending.member = pending.member, None
        if member is not None:
            member.inflight -= 1
            member.outstanding = max(0.0, member.outstanding - pending.remaining) if member.inflight else 0.0

    def _finish(self, pending: _Pending, last: RequestOutput) -> None:
        if pending.done:
            return
        pending.done = True
        self._release(pending)
        self.policy.on_finish(pending.seq)
        self._requests.pop(pending.request_id, None)
        pending.deltas.put_nowait(last)
        self._wake.set()

    # -- health -----------------------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self._pool.probe_interval_s)
            await asyncio.gather(*(self._probe(m) for m in self._members))

    async def _probe(self, member: _Member) -> None:
        try:
            member.info = await member.backend.probe()
        except Exception as exc:  # whatever it answered, a probe that fails leaves the loop probing
            self._take_out(member, f"probe failed: {exc}")
            return
        if not member.healthy:
            member.healthy = True
            index = self._members.index(member)
            for pending in self._waiting:
                pending.tried.discard(index)
            log.info("backend %s is in", member.backend.name)
            self._wake.set()
