"""The synchronous engine: one ``step()`` plans a batch, runs the model, samples, and reports deltas.

``EngineCore`` is driven by one thread (``engine.client.AsyncEngine`` runs it on its own). For offline work
there is ``generate_offline(core, requests)``: it submits every ``(prompt_token_ids, SamplingParams)`` pair at
once, steps until all finish and returns one merged ``RequestOutput`` per request, in order (the benchmark
times Weir with it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from engine.calibration import calibrate, calibration_shapes
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager, num_blocks_for_memory
from engine.model_runner import ModelRunner
from engine.policies import make_policy
from engine.sampler import StopStringMatcher, make_generator, sample
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_time import StepTimeModel
from engine.types import EngineStats, RequestOutput, SamplingParams, TTFTEstimate

log = logging.getLogger("weir.engine")

RATE_WINDOW_S = 10.0  # tokens/s in stats are measured over this window
TTFT_RATIO_WINDOW = 500  # recent requests behind the estimate's error figures in stats
TENANT_RATIO_WINDOW = 32  # a tenant's recent requests behind its own estimate error
# the quantile of recent estimate errors that admission corrects by: a high one, because under overload most
# admitted requests are predicted near the target, and it is the tail of their TTFT that must meet it
TTFT_RATIO_TAIL = 0.95
# errors a tail is taken from (the engine's and a tenant's own): more than 20, so that the 95th percentile
# is not simply the largest of a few, which one short wait behind a long prefill step sets after a start
RATIO_TAIL_MIN = 21
TENANT_RATIO_TENANTS = 1000  # tenants whose error is kept (the least recently served are forgotten)


@dataclass(eq=False)
class _Request:
    seq: Sequence
    detokenizer: object  # engine.tokenizer.IncrementalDetokenizer
    stops: StopStringMatcher
    generator: torch.Generator | None


class EngineCore:
    """Continuous batching over a paged KV cache, one step at a time."""

    def __init__(
        self,
        model,  # engine.models.PagedLlama
        tokenizer,  # engine.tokenizer.Tokenizer
        config: EngineConfig,
        *,
        num_blocks: int,
        device: torch.device,
        model_name: str = "model",
    ) -> None:
        """An engine over a loaded ``model`` with ``num_blocks`` KV blocks on ``device``; every limit comes
        from ``config`` (``from_config`` loads the model it names and sizes the pool)."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.device = device
        self.kv = KVCacheManager(num_blocks, config.block_size, config.prefix_caching)
        self.runner = ModelRunner(model, self.kv, device)
        limit = min(model.config.max_position_embeddings, self.kv.capacity_tokens)
        self.max_model_len = min(limit, config.max_model_len) if config.max_model_len else limit
        self.scheduler = Scheduler(
            self.kv,
            make_policy(config.policy),
            config,
            max_model_len=self.max_model_len,
            prefill_budget=lambda decodes, seconds: self._step_time.costs().prefill_tokens_within(
                seconds, decodes
            ),
        )
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(model.config.eos_token_ids)
        self.vocab_size = model.config.vocab_size
        self._requests: dict[str, _Request] = {}
        self._aborted: list[RequestOutput] = []
        self._steps = 0
        self._step_seconds = 0.0
        self._window: deque[tuple[float, int, int]] = deque()  # (step start, output tokens, prompt tokens)
        self._window_sums = [0, 0]
        self._step_time = StepTimeModel()
        shapes = calibration_shapes(config.max_batched_tokens, config.max_num_seqs, self.max_model_len)
        self._step_time.calibrate(calibrate(self.runner, shapes))
        self._ttft_ratios: deque[float] = deque(maxlen=TTFT_RATIO_WINDOW)
        self._tenant_ratios: OrderedDict[str, deque[float]] = OrderedDict()
        self._tenant_ratio_tail: dict[str, float] = {}  # other threads only ``get`` from it
        self._ttft_ratio_quantiles: tuple[float | None, float | None] = (None, None)
        self._queued_prefill: dict[str, int] = {}
        self._step_limit = config.max_batched_tokens  # of a step beside the running decodes (``_refresh``)
        self._stats = self._snapshot()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> EngineCore:
        """Load the model and tokenizer named by ``config`` and size the KV pool from its memory budget."""
        from engine.models import load_model
        from engine.tokenizer import Tokenizer
        from engine.weights import resolve_model_dir

        model_dir = resolve_model_dir(config.model, config.resolved_state_dir(), progress=progress)
        device = config.torch_device()
        model = load_model(model_dir, device, config.dtype)
        bytes_per_block = model.kv_bytes_per_block(config.block_size)
        num_blocks = config.num_kv_blocks or num_blocks_for_memory(config.kv_cache_memory, bytes_per_block)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB) on %s",
            num_blocks,
            config.block_size,
            num_blocks * bytes_per_block / 2**20,
            device,
        )
        return cls(
            model,
            Tokenizer(model_dir),
            config,
            num_blocks=num_blocks,
            device=device,
            model_name=model_dir.name,
        )

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request the engine cannot take (a too long prompt ends with an error)."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        if not prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant_id: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
        tpot_target_s: float | None = None,
        weight: float = 1.0,
        start_within_s: float | None = None,
    ) -> None:
        """Queue a request; its outputs come from the following ``step()`` calls. With a ``tpot_target_s``,
        steps that decode it carry no more prefill than the step-time model says fits in that time.
        ``weight`` is the tenant's share under the fair policy (its latest request's weight counts). A
        request still waiting ``start_within_s`` after its arrival, never started, ends unstarted with
        finish reason ``deadline`` instead of being served late."""
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        if start_within_s is not None and not start_within_s >= 0:
            raise ValueError(f"start_within_s must be non-negative, got {start_within_s}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.check_request(prompt_token_ids, params)
        from engine.tokenizer import IncrementalDetokenizer

        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            tenant_id=tenant_id,
            priority=priority,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            tpot_target_s=tpot_target_s,
            weight=weight,
        )
        if start_within_s is not None:
            seq.start_deadline = seq.arrival_time + start_within_s
        seq.expected_cached_tokens = self.cached_prefix_tokens(seq.prompt_token_ids, tenant_id)
        prefill = seq.num_prompt_tokens - seq.expected_cached_tokens
        seq.predicted_ttft = self.estimate_ttft(prefill, tenant_id, weight).seconds
        self._requests[request_id] = _Request(
            seq,
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids),
            StopStringMatcher(params.stop),
            make_generator(params, self.device),
        )
        self.scheduler.add(seq)
        self._refresh()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks now; False if it is not (or no longer) in the engine."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request.seq, "abort")
        self._aborted.append(self._output(request.seq, "", [], []))
        self._refresh()
        return True

    def end_all(self, reason: str, error: str | None = None) -> list[RequestOutput]:
        """End every request in the engine (shutdown, or a failed step) and free all blocks."""
        outputs, self._aborted = self._aborted, []
        for request in self._requests.values():
            self.scheduler.finish(request.seq, reason, error)
            outputs.append(self._output(request.seq, "", [], []))
        self._requests.clear()
        self._refresh()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; return a delta for every request that produced tokens or ended."""
        outputs, self._aborted = self._aborted, []
        started = time.monotonic()
        plan = self.scheduler.schedule()
        for seq in plan.rejected:
            del self._requests[seq.request_id]
            outputs.append(self._output(seq, "", [], []))
        new_tokens = 0
        if plan.scheduled:
            logits = self.runner.run(plan.scheduled)
            self.scheduler.complete(plan)
            requests = [self._requests[seq.request_id] for seq in plan.sample_seqs]
            tokens = sample(logits, [r.seq.params for r in requests], [r.generator for r in requests])
            now = time.monotonic()
            outputs.extend(self._advance(r, token, now) for r, token in zip(requests, tokens, strict=True))
            new_tokens = len(tokens)
            self._step_time.observe(plan.num_prefill_tokens, plan.num_decode_tokens, now - started, now)
            self._steps += 1
            self._step_seconds += now - started
            self._record(started, new_tokens, plan.num_prefill_tokens)
        self._refresh()
        return outputs

    def _advance(self, request: _Request, token: int, now: float) -> RequestOutput:
        """Append a sampled token, decide whether the request ends, and make its delta."""
        seq, params = request.seq, request.seq.params
        self.scheduler.append_token(seq, token)
        if seq.first_token_time is None:
            seq.first_token_time = now
            self._record_ttft(seq)
        text, hit, reason = "", False, None
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        else:
            text, hit = request.stops.push(request.detokenizer.push([token]))
            reason = "stop" if hit else None
        at_limit = seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        if reason is None and at_limit:
            reason = "length"
        if reason is not None:
            if not hit:  # the output ends here: release text held back for a possible stop string
                tail, hit = request.stops.push(request.detokenizer.flush())
                text += tail if hit else tail + request.stops.flush()
            self.scheduler.finish(seq, reason)
            del self._requests[seq.request_id]
        return self._output(seq, text, [token], [now])

    def _output(self, seq: Sequence, text: str, token_ids: list[int], times: list[float]) -> RequestOutput:
        """A delta of ``seq``. Its prompt counts are what ran: all of the prompt once a token was sampled,
        only the chunks computed of one that ended mid-prefill, none of one that ended before it ran
        (aborted or refused while queued), so that work never done is never billed."""
        queue_time = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
        computed = seq.num_prompt_tokens_billed
        return RequestOutput(
            request_id=seq.request_id,
            text=text,
            token_ids=token_ids,
            token_times=times,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=computed,
            cached_tokens=min(seq.num_cached_tokens, computed),
            output_tokens=seq.num_output_tokens,
            arrival_time=seq.arrival_time,
            queue_time=queue_time,
            first_token_time=seq.first_token_time,
            error=seq.error,
        )

    def _record(self, started: float, output_tokens: int, prompt_tokens: int) -> None:
        now = time.monotonic()
        self._window.append((started, output_tokens, prompt_tokens))
        self._window_sums[0] += output_tokens
        self._window_sums[1] += prompt_tokens
        while self._window and self._window[0][0] < now - RATE_WINDOW_S:
            _, out, prompt = self._window.popleft()
            self._window_sums[0] -= out
            self._window_sums[1] -= prompt

    def _record_ttft(self, seq: Sequence) -> None:
        """Keep how far the request's first token came from the estimate made at its arrival."""
        if not seq.predicted_ttft:
            return
        ratio = (seq.first_token_time - seq.arrival_time) / seq.predicted_ttft
        self._ttft_ratios.append(ratio)
        ratios = sorted(self._ttft_ratios)
        self._ttft_ratio_quantiles = (_quantile(ratios, 0.5), _tail(ratios))
        tenant = self._tenant_ratios.pop(seq.tenant_id, None) or deque(maxlen=TENANT_RATIO_WINDOW)
        tenant.append(ratio)
        self._tenant_ratios[seq.tenant_id] = tenant
        if (tail := _tail(sorted(tenant))) is not None:
            self._tenant_ratio_tail[seq.tenant_id] = tail
        while len(self._tenant_ratios) > TENANT_RATIO_TENANTS:
            forgotten, _ = self._tenant_ratios.popitem(last=False)
            self._tenant_ratio_tail.pop(forgotten, None)

    def _refresh(self) -> None:
        self._queued_prefill = self.scheduler.queued_prefill_by_tenant()
        self._step_limit = self.scheduler.step_token_limit()
        self._stats = self._snapshot()

    def _snapshot(self) -> EngineStats:
        span = RATE_WINDOW_S
        if self._window:
            span = min(RATE_WINDOW_S, max(time.monotonic() - self._window[0][0], 1e-3))
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            waiting_by_tenant=dict(Counter(seq.tenant_id for seq in self.scheduler.waiting)),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_cached=self.kv.allocator.num_cached,
            block_size=self.kv.block_size,
            tokens_per_s=self._window_sums[0] / span,
            prompt_tokens_per_s=self._window_sums[1] / span,
            steps=self._steps,
            step_seconds=self._step_seconds,
            preemptions=self.scheduler.num_preemptions,
            ttft_estimate_ratio_p50=self._ttft_ratio_quantiles[0],
            ttft_estimate_ratio_p95=self._ttft_ratio_quantiles[1],
        )

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (safe to read from another thread)."""
        stats = self._stats
        window = self._window
        if window and time.monotonic() - window[-1][0] > RATE_WINDOW_S:  # idle for a whole window
            return replace(stats, tokens_per_s=0.0, prompt_tokens_per_s=0.0)
        return stats

    def cached_prefix_tokens(self, prompt_ids: list[int], tenant_id: str = "default") -> int:
        """How many of a new request's prompt tokens the tenant's prefix cache would serve now (an estimate
        when asked from another thread than the engine's)."""
        return self.scheduler.kv.cached_prefix_tokens(prompt_ids, tenant_id)

    def estimate_ttft(
        self,
        prompt_tokens: int,
        tenant_id: str = "default",
        weight: float = 1.0,
        extra_queued: Mapping[str, int] | None = None,
    ) -> TTFTEstimate:
        """A new request's time to first token: the prefill ahead of it (per the policy) and its own,
        beside the decodes running now, in steps as large as their time-per-token targets allow, timed by
        the step-time model (see ``engine/step_time.py``).
        ``extra_queued`` is prefill per tenant about to join the queue (submitted, not yet taken in)."""
        queued = Counter(self._queued_prefill)
        queued.update(extra_queued or {})
        costs = self._step_time.costs()
        ahead, seconds = 0, 0.0
        for _ in range(2):  # the second pass adds what others send within the first pass's wait
            ahead = self.scheduler.policy.tokens_ahead(queued, tenant_id, prompt_tokens, weight, seconds)
            tokens = ahead + max(prompt_tokens, 1)
            seconds = costs.prefill_seconds(tokens, self._stats.running, self._step_limit)
        share = self.scheduler.policy.share_ratio(tenant_id, weight)
        return TTFTEstimate(
            seconds=seconds,
            queued_tokens=ahead,
            reliable=costs.reliable,
            share_ratio=share,
            tenant_ratio_tail=self._tenant_ratio_tail.get(tenant_id),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of a sorted, non-empty list (nearest rank)."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tail(ordered: list[float]) -> float | None:
    """The ``TTFT_RATIO_TAIL`` quantile of sorted estimate errors; None while they are too few for one."""
    return _quantile(ordered, TTFT_RATIO_TAIL) if len(ordered) >= RATIO_TAIL_MIN else None


def generate_offline(
    core: EngineCore, requests: Iterable[tuple[list[int], SamplingParams]]
) -> list[RequestOutput]:
    """Run all requests to completion together; one merged output per request, in the given order."""
    results: dict[str, RequestOutput] = {}
    order = []
    for i, (prompt, params) in enumerate(requests):
        request_id = f"offline-{i}"
        core.add_request(request_id, prompt, params)
        order.append(request_id)
    while core.has_unfinished():
        for out in core.step():
            if out.request_id in results:
                results[out.request_id].merge(out)
            else:
                results[out.request_id] = out
    return [results[request_id] for request_id in order]
