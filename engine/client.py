"""``AsyncEngine``: the asyncio face of the engine, with the step loop on its own thread.

Callers submit requests and read each one's deltas from an async iterator. The engine thread never waits on
a consumer: every request has an output slot that merges deltas until its consumer reads them, and wakes
the consumer's event loop with ``call_soon_threadsafe``. A consumer that stops iterating or is cancelled
aborts its request, which frees its KV blocks within one step.

Every torch operation of the engine runs on the engine thread, the model's loading included. GNU OpenMP
(torch's CPU wheels) shortens its workers' spin-wait once more threads have started parallel regions than
there are cores, and each parallel region then wakes its workers from sleep: on a 2-core machine a 1-row
bf16 product took 70 us on the first thread to run one and 165 us on a second, and a decode step ran 28 ms
against 46 ms.

    async with AsyncEngine(EngineConfig()) as engine:
        async for delta in engine.generate("r1", ids, SamplingParams(max_tokens=32)):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.types import EngineStats, RequestOutput, SamplingParams, TTFTEstimate

__all__ = ["AsyncEngine", "EngineConfig"]

log = logging.getLogger("weir.engine")


class _OutputSlot:
    """Holds one request's not-yet-read deltas, merged into one; written by the engine thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._ready = asyncio.Event()

    def put(self, delta: RequestOutput) -> None:
        with self._lock:
            wake = self._pending is None
            if wake:
                self._pending = delta
            else:
                self._pending.merge(delta)
        if wake:
            # RuntimeError: the consumer's loop is closed, nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._ready.set)

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        with self._lock:
            delta, self._pending = self._pending, None
            self._ready.clear()
        return delta


class AsyncEngine:
    """An engine serving concurrent requests to asyncio code."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._core: EngineCore | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue[Callable[[EngineCore], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._slots: dict[str, _OutputSlot] = {}
        # prompt tokens and tenant of requests not yet taken in by the engine thread
        self._submitted: dict[str, tuple[str, int]] = {}

    async def start(self) -> None:
        """Start the engine thread, which loads the model (the first time) before it steps; returns once
        the model is loaded, and raises what loading raised."""
        if self._thread is not None:
            return
        loop = asyncio.get_running_loop()
        loaded: asyncio.Future[None] = loop.create_future()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, args=(loop, loaded), name="weir-engine", daemon=True
        )
        self._thread.start()
        try:
            await loaded
        except BaseException:
            self._stopping = True
            self._wakeup.set()
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise

    async def stop(self) -> None:
        """Stop the engine thread; requests still in flight end with finish reason "abort"."""
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def core(self) -> EngineCore:
        if self._core is None:
            raise RuntimeError("the engine is not started (await engine.start() first)")
        return self._core

    @property
    def tokenizer(self):  # -> engine.tokenizer.Tokenizer
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas; the last one has ``finished`` set. Bad input raises ValueError.
        ``tpot_target_s``, ``weight`` and ``start_within_s`` are as in ``EngineCore.add_request``."""
        core = self.core
        if self._thread is None:
            raise RuntimeError("the engine is stopped")
        if request_id in self._slots:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        core.check_request(prompt_token_ids, params)
        slot = _OutputSlot(asyncio.get_running_loop())
        self._slots[request_id] = slot
        uncached = len(prompt_token_ids) - core.cached_prefix_tokens(list(prompt_token_ids), tenant_id)
        self._submitted[request_id] = (tenant_id, uncached)
        prompt = list(prompt_token_ids)
        arrival = time.monotonic()

        def add(core: EngineCore) -> None:
            self._submitted.pop(request_id, None)
            try:
                core.add_request(
                    request_id,
                    prompt,
                    params,
                    tenant_id,
                    priority,
                    arrival,
                    tpot_target_s,
                    weight,
                    start_within_s,
                )
            except ValueError as exc:
                refused = RequestOutput(request_id, finished=True, finish_reason="error", error=str(exc))
                self._deliver([refused])

        self._submit(add)
        finished = False
        try:
            while not finished:
                delta = await slot.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request (no-op if it already ended); its blocks are freed before the next step."""
        self._submit(lambda core: core.abort(request_id))

    def stats(self) -> EngineStats:
        return self.core.stats()

    def estimate_ttft(
        self, prompt_tokens: int, tenant_id: str = "default", weight: float = 1.0
    ) -> TTFTEstimate:
        """A new request's predicted time to first token, from the prefill work queued ahead of it
        (requests submitted but not yet taken in by the engine thread included)."""
        queued: Counter[str] = Counter()
        for tenant, tokens in list(self._submitted.values()):
            queued[tenant] += tokens
        return self.core.estimate_ttft(prompt_tokens, tenant_id, weight, extra_queued=queued)

    def cached_prefix_tokens(self, prompt_ids: list[int], tenant_id: str = "default") -> int:
        """How many of a new request's prompt tokens the prefix cache would serve now (an estimate: the
        engine thread may change the cache before the request reaches it)."""
        return self.core.cached_prefix_tokens(prompt_ids, tenant_id)

    def _submit(self, command: Callable[[EngineCore], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self, loop: asyncio.AbstractEventLoop, loaded: asyncio.Future[None]) -> None:
        """The engine thread: load the model if not yet loaded, then apply commands, step while there is
        work, deliver deltas to the slots."""
        try:
            if self._core is None:
                self._core = EngineCore.from_config(self.config, False)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, loaded, exc)
            return
        loop.call_soon_threadsafe(_settle, loaded, None)
        core = self._core
        while not self._stopping:
            self._apply_commands(core)
            if not core.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = core.step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                outputs = core.end_all("error", "internal engine error")
            self._deliver(outputs)
        self._apply_commands(core)
        self._deliver(core.end_all("abort"))

    def _apply_commands(self, core: EngineCore) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command(core)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for delta in outputs:
            slot = self._slots.get(delta.request_id)
            if slot is not None:
                slot.put(delta)
            if delta.finished:
                self._slots.pop(delta.request_id, None)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolve ``future`` (on its loop) with ``error`` or with None, unless a cancelled caller left it."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
