"""Paged attention against a plain per-sequence reference over random caches."""

from __future__ import annotations

import math

import pytest
import torch

from engine.batch import StepBatch
from engine.models.attention import AttentionPlan, GatherBuffers, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention of queries at positions offset.. over keys 0..; heads expanded the plain way."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dim]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)  # [heads, q, ctx]
    allowed = torch.arange(keys.shape[0])[None, :] <= torch.arange(offset, offset + q.shape[0])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(q.shape[0], HEADS * HEAD_DIM)


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_matches_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # decodes of very different lengths (several padded groups), then a fresh prefill and a later chunk
    seqs = [(1, n) for n in (1, 2, 5, 9, 33, 34, 120, 200, 7)] + [(13, 13), (6, 27)]
    num_blocks = sum(-(-ctx // BLOCK) + 1 for _, ctx in seqs)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    key_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    value_cache = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = [[free.pop() for _ in range(-(-ctx // BLOCK) + 1)] for _, ctx in seqs]  # one spare block each
    slots = [
        [t[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx)]
        for t, (_, ctx) in zip(tables, seqs, strict=True)
    ]
    step_slots = torch.tensor(
        [s for (q_len, ctx), ss in zip(seqs, slots, strict=True) for s in ss[ctx - q_len :]]
    )
    total = len(step_slots)
    batch = StepBatch(
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.zeros(total, dtype=torch.int64),
        slot_mapping=step_slots,
        query_lens=[q for q, _ in seqs],
        context_lens=[c for _, c in seqs],
        block_tables=tables,
        logits_indices=torch.zeros(0, dtype=torch.int64),
        num_decodes=9,
    )
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    plan = AttentionPlan.build(batch, BLOCK, HEAD_DIM, torch.device("cpu"), torch.float32)
    assert len(plan.decodes) > 1
    out = paged_attention(
        q,
        key_cache[step_slots],
        value_cache[step_slots],
        key_cache,
        value_cache,
        BLOCK,
        plan,
        GatherBuffers(),
    )
    start = 0
    for (q_len, ctx), seq_slots in zip(seqs, slots, strict=True):
        idx = torch.tensor(seq_slots)
        expected = reference(q[start : start + q_len], key_cache[idx], value_cache[idx], ctx - q_len)
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-5, atol=1e-5)
        start += q_len


def test_inconsistent_batch_is_refused() -> None:
    batch = StepBatch(
        input_ids=torch.zeros(2, dtype=torch.int64),
        positions=torch.arange(2),
        slot_mapping=torch.arange(2),
        query_lens=[2],
        context_lens=[9],
        block_tables=[[0]],
        logits_indices=torch.tensor([1]),
        num_decodes=0,
    )
    with pytest.raises(ValueError, match="disagree"):
        AttentionPlan.build(batch, BLOCK, HEAD_DIM, torch.device("cpu"), torch.float32)
