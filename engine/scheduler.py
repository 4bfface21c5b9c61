"""Iteration-level continuous batching: plan each engine step under a token budget.

Every step, running decodes go first (one token each); the rest of the budget goes to prefill chunks in the
policy's order over both the prompts already being prefilled and the waiting requests, which are admitted
with their first chunk while the running-sequence cap and free KV blocks allow. (Ordering the chunks, not
only the admissions, is what lets a fair policy serve a light tenant's prompt before a heavy tenant's long
prompts that were admitted earlier.) A prompt is cut into chunks of at most
``prefill_chunk_size`` tokens so a long one cannot stall everyone's decoding. When a running sequence needs
a block and none is free, the policy picks a victim, whose blocks are freed and whose tokens are recomputed
when it is admitted again (recompute preemption).

``schedule()`` returns a ``StepPlan``: plain data, the sequences of the step and how many tokens each
runs; the model runner makes the step's tensors from it. Nothing is counted as done before the model ran:
``complete(plan)`` then advances the computed-token counts, registers full blocks with the prefix cache
and reports the served prompt tokens to the policy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.policies import Policy
from engine.sequence import Sequence, SequenceStatus

MIN_PREFILL_TOKENS = 16  # prefill a step may carry beside decodes even when their target leaves no room
# Steps beside decodes aim at this share of their tightest time-per-token target: the step-time model's
# error and the time between steps (sampling, streaming) must still fit within the target.
TPOT_HEADROOM = 0.8


@dataclass
class StepPlan:
    """One planned step: the sequences that run and how many tokens each, decodes (one token) first."""

    scheduled: list[tuple[Sequence, int]]
    sample_seqs: list[Sequence]  # row i of the step's logits is the next-token distribution of sample_seqs[i]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # finished with an error while planning


class Scheduler:
    """Owns the waiting and running queues; their sequences' KV blocks are taken and freed through ``kv``."""

    def __init__(
        self,
        kv: KVCacheManager,
        policy: Policy,
        config: EngineConfig,
        *,
        max_model_len: int,
        prefill_budget: Callable[[int, float], int] | None = None,
    ) -> None:
        """Limits come from ``config``; ``max_model_len`` is the engine's resolved context limit."""
        if max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        if max_model_len > kv.capacity_tokens:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the KV pool of {kv.capacity_tokens} tokens"
            )
        self.kv = kv
        self.policy = policy
        self.max_model_len = max_model_len
        self.max_batched_tokens = config.max_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.prefill_chunk_size = config.prefill_chunk_size
        # (decodes, seconds) -> prefill tokens a step can add and still take that long (stall-free batching)
        self.prefill_budget = prefill_budget
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.policy.on_arrival(seq)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Take the sequence out of the engine and free its blocks at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.policy.on_finish(seq)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        seq.token_ids.append(token_id)
        self.policy.on_tokens(seq, 0, 1)

    def queued_prefill_by_tenant(self) -> dict[str, int]:
        """Prefill tokens not yet computed, per tenant (what a new request waits behind); of a sequence
        not yet started, those its prefix cache did not hold when it arrived."""
        queued: dict[str, int] = defaultdict(int)
        for seq in (*self.waiting, *self.running):
            uncomputed = seq.num_uncomputed_tokens
            if seq.num_computed_tokens == 0:
                uncomputed -= seq.expected_cached_tokens
            if uncomputed > 1:
                queued[seq.tenant_id] += uncomputed
        return dict(queued)

    def schedule(self) -> StepPlan:
        """Plan the next step; the planned sequences hold the KV blocks their tokens need."""
        expired = self._refuse_expired(time.monotonic())
        planned: dict[str, tuple[Sequence, int]] = {}
        preempted: list[Sequence] = []
        budget = self.max_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            is_decode = seq.status is SequenceStatus.RUNNING and seq.num_uncomputed_tokens == 1
            if is_decode and self._reserve(seq, 1, planned, preempted):
                planned[seq.request_id] = (seq, 1)
                budget -= 1
        budget = max(0, self._stall_free_limit([seq for seq, _ in planned.values()]) - len(planned))
        rejected = self._prefill(planned, preempted, budget)
        for seq in preempted:
            self.waiting.append(seq)
        plan = self._plan(list(planned.values()))
        plan.preempted, plan.rejected = preempted, expired + rejected
        return plan

    def complete(self, plan: StepPlan) -> None:
        """The model ran ``plan``: its tokens' K/V are in the cache. Advance the computed-token counts,
        register the blocks now full with the prefix cache, and report the prompt tokens served (cached
        ones at the sequence's first step; recomputed ones never) to the policy."""
        for seq, n in plan.scheduled:
            end = seq.num_computed_tokens + n
            if seq.num_prompt_tokens_billed < seq.num_cached_tokens:
                seq.num_prompt_tokens_billed = seq.num_cached_tokens
                self.policy.on_tokens(seq, 0, 0, seq.num_cached_tokens)
            fresh_prompt = max(0, min(end, seq.num_prompt_tokens) - seq.num_prompt_tokens_billed)
            if fresh_prompt:
                seq.num_prompt_tokens_billed += fresh_prompt
                self.policy.on_tokens(seq, fresh_prompt, 0)
            seq.num_computed_tokens = end
            self.kv.cache_full_blocks(seq.request_id, seq.token_ids, end, seq.tenant_id)

    def _refuse_expired(self, now: float) -> list[Sequence]:
        """End the waiting requests that were never started and whose start deadline has passed."""
        expired = [
            seq
            for seq in self.waiting
            if seq.first_scheduled_time is None and now > (seq.start_deadline or float("inf"))
        ]
        for seq in expired:
            waited = now - seq.arrival_time
            self.finish(seq, "deadline", f"not started within its deadline (waited {waited:.2f} s)")
        return expired

    def step_token_limit(self) -> int:
        """The token limit of a step that decodes every running sequence (what a TTFT estimate assumes)."""
        return self._stall_free_limit(self.running)

    def _stall_free_limit(self, decodes: list[Sequence]) -> int:
        """The step's token limit beside ``decodes``: the prefill that fits within ``TPOT_HEADROOM`` of the
        tightest time-per-token target among them joins them (at least ``MIN_PREFILL_TOKENS``, so prompts
        progress)."""
        targets = [seq.tpot_target_s for seq in decodes if seq.tpot_target_s]
        if not targets or self.prefill_budget is None:
            return self.max_batched_tokens
        fits = max(MIN_PREFILL_TOKENS, self.prefill_budget(len(decodes), TPOT_HEADROOM * min(targets)))
        return min(self.max_batched_tokens, len(decodes) + fits)

    def _reserve(
        self, seq: Sequence, n: int, planned: dict[str, tuple[Sequence, int]], preempted: list[Sequence]
    ) -> bool:
        """Get blocks for ``n`` more tokens of a running sequence, preempting others if needed.

        Returns False when the sequence itself was the policy's victim.
        """
        while not self.kv.grow(seq.request_id, seq.num_computed_tokens + n):
            victim = self.policy.pick_victim(self.running)
            self._preempt(victim, planned)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, planned: dict[str, tuple[Sequence, int]]) -> None:
        planned.pop(seq.request_id, None)
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.num_preemptions += 1

    def _prefill(
        self, planned: dict[str, tuple[Sequence, int]], preempted: list[Sequence], budget: int
    ) -> list[Sequence]:
        """Fill the budget with prefill chunks, in the policy's order over the running prompts still being
        prefilled and the waiting requests (admitted with their first chunk); return those rejected."""
        rejected: list[Sequence] = []
        candidates = [s for s in self.running if s.num_uncomputed_tokens > 1 and s.request_id not in planned]
        candidates += self.waiting
        by_tenant: dict[str, int] = defaultdict(int)  # prefill planned so far, for the policy's order
        admitting = True
        while candidates and budget > 0:
            if not (admitting and len(self.running) < self.max_num_seqs):
                # nothing more is admitted this step: only prompts already running can still be chosen
                # (the waiting ones would each be picked and passed over, a policy call apiece)
                candidates = [c for c in candidates if c.status is SequenceStatus.RUNNING]
                if not candidates:
                    break
            seq = self.policy.pick_next(candidates, by_tenant)
            candidates.remove(seq)
            left = budget
            if seq.status is SequenceStatus.RUNNING:
                n = min(seq.num_uncomputed_tokens, self.prefill_chunk_size, budget)
                if self._reserve(seq, n, planned, preempted):
                    planned[seq.request_id] = (seq, n)
                    budget -= n
                candidates = [c for c in candidates if c not in preempted]
            elif admitting and len(self.running) < self.max_num_seqs:
                admitting, budget = self._admit(seq, planned, budget, rejected)
            by_tenant[seq.tenant_id] += left - budget
        return rejected

    def _admit(
        self, seq: Sequence, planned: dict[str, tuple[Sequence, int]], budget: int, rejected: list[Sequence]
    ) -> tuple[bool, int]:
        """Move a waiting sequence into the running set with its first chunk (or reject it); return whether
        admitting may go on (False once KV blocks ran out) and the budget left."""
        if seq.num_tokens > self.max_model_len:
            self.finish(
                seq,
                "error",
                f"prompt of {seq.num_tokens} tokens exceeds the engine's limit of {self.max_model_len}",
            )
            rejected.append(seq)
            return True, budget
        seq.num_computed_tokens = self.kv.share_prefix(seq.request_id, seq.token_ids, seq.tenant_id)
        n = min(seq.num_uncomputed_tokens, self.prefill_chunk_size, budget)
        if not self.kv.grow(seq.request_id, seq.num_computed_tokens + n):
            self.kv.free(seq.request_id)
            seq.num_computed_tokens = 0
            return False, budget
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = seq.num_computed_tokens  # billed at the cached weight by complete()
        planned[seq.request_id] = (seq, n)
        return True, budget - n

    @staticmethod
    def _plan(planned: list[tuple[Sequence, int]]) -> StepPlan:
        """The step's sequences, decodes first, and which of them yield logits (those reaching their end)."""
        planned.sort(key=lambda item: item[1] != 1)
        sample_seqs = [seq for seq, n in planned if seq.num_computed_tokens + n == seq.num_tokens]
        num_prefill = sum(n for seq, n in planned if seq.num_uncomputed_tokens > 1)
        total = sum(n for _, n in planned)
        return StepPlan(planned, sample_seqs, num_prefill, total - num_prefill)
