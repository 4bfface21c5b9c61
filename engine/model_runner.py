"""The model runner: turns a step plan into the step's tensors and runs the model on them.

The scheduler decides which sequences run how many tokens (``StepPlan``, plain data); this module lays
those tokens out as one flat ``StepBatch`` (positions, KV slots, block tables, the rows whose logits are
needed) on the model's device and returns the next-token logits.
"""

from __future__ import annotations

import torch

from engine.batch import KVCacheTensors, StepBatch
from engine.kv_cache import KVCacheManager
from engine.sequence import Sequence


def step_batch(scheduled: list[tuple[Sequence, int]], kv: KVCacheManager, device: torch.device) -> StepBatch:
    """The flat batch of ``scheduled`` (decodes first): each sequence's next ``n`` uncomputed tokens, and
    a logits row for each sequence whose chunk reaches its last token."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    block_tables: list[list[int]] = []
    logits_indices: list[int] = []
    for seq, n in scheduled:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(kv.slots(seq.request_id, start, end))
        query_lens.append(n)
        context_lens.append(end)
        block_tables.append(kv.table(seq.request_id))
        if end == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
    return StepBatch.from_lists(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        logits_indices=logits_indices,
        device=device,
    )


class ModelRunner:
    """The model, its KV memory and the device its step tensors go to."""

    def __init__(
        self, model, kv: KVCacheManager, device: torch.device
    ) -> None:  # model: engine.models.PagedLlama
        self.model = model
        self.kv = kv
        self.device = device
        self.kv_tensors: KVCacheTensors = model.new_kv_cache(kv.num_blocks, kv.block_size)

    def run(self, scheduled: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Logits [sequences yielding a token, vocab] of one step over ``scheduled``."""
        return self.model.forward(step_batch(scheduled, self.kv, self.device), self.kv_tensors)
