"""Attention over the paged KV cache.

The step's metadata is built once per step by :meth:`AttentionPlan.build` and reused by every layer. There
are two implementations, chosen per step by ``$WEIR_ATTENTION``:

- ``kernel`` (the default): the C++ kernel of ``engine/models/paged_kernel.py`` reads each sequence's blocks
  in place, decodes and prefill chunks together in one call per layer. It runs CPU steps in fp32 and bf16
  with head sizes 16, 32, 64 and 128; any other step, or a machine where it cannot be built, takes the
  reference.
- ``reference``: the context blocks are gathered into contiguous buffers, then attended with SDPA. Decodes
  (query length 1) run together as a padded batch: their context blocks are gathered with one
  ``index_select`` and attended in one SDPA call, with the query heads of each KV head grouped so K/V are
  never repeated; decodes of very different context lengths are split into a few groups of similar length
  so that little of the padded layout is wasted. Prefill chunks run one SDPA call each: a chunk that starts
  its sequence attends causally to the step's own K/V; a later chunk reads its earlier context from its
  blocks with a causal mask offset by that context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.batch import StepBatch
from engine.models.paged_kernel import KernelBatch, kernel_available, kernel_supports

# Planning cost of one more decode group, in padded context tokens (an extra gather and SDPA call per layer).
GROUP_COST_TOKENS = 256
# At most this many candidate group boundaries are considered (keeps planning cheap for huge batches).
MAX_GROUP_BOUNDARIES = 64
ATTENTION_ENV = "WEIR_ATTENTION"
BACKENDS = ("kernel", "reference")


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended together in one padded [count, padded_len] layout."""

    rows: torch.Tensor  # [count] int64, their rows in the flat batch
    count: int
    block_ids: torch.Tensor  # [count * blocks_per_seq] int64, padded with block 0 (masked out)
    padded_len: int
    mask: torch.Tensor | None  # [count, 1, 1, padded_len] additive (-inf on padding); None if no padding


@dataclass(frozen=True)
class PrefillPlan:
    """One prefill chunk: its rows in the step and where its context lives."""

    start: int  # first row of the chunk in the flat batch
    length: int  # query tokens in this step
    context_len: int  # tokens in the cache after this step, the chunk's own included
    block_ids: torch.Tensor | None  # blocks holding the context; None when the chunk is all of it
    mask: torch.Tensor | None  # [length, context_len] bool, True where a query may attend


@dataclass(frozen=True)
class AttentionPlan:
    """Everything the layers need to run attention for one step."""

    decodes: list[DecodeGroup]
    prefills: list[PrefillPlan]
    scale: float
    kernel: KernelBatch | None = None  # set when the kernel runs this step (decodes and prefills empty)

    @classmethod
    def build(
        cls,
        batch: StepBatch,
        block_size: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: str | None = None,
    ) -> AttentionPlan:
        """Plan attention for ``batch`` with ``backend`` (default: :func:`attention_backend`); raise
        ValueError when its per-sequence lists disagree, RuntimeError for a kernel that could not be built."""
        count = len(batch.query_lens)
        if len(batch.context_lens) != count or len(batch.block_tables) != count:
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        if sum(batch.query_lens) != batch.num_tokens:
            raise ValueError(
                f"query_lens sum to {sum(batch.query_lens)}, but the step has {batch.num_tokens} tokens"
            )
        for seq, (q_len, ctx_len, table) in enumerate(
            zip(batch.query_lens, batch.context_lens, batch.block_tables, strict=True)
        ):
            if q_len < 1 or ctx_len < q_len or len(table) * block_size < ctx_len:
                raise ValueError(
                    f"sequence {seq}: query_len {q_len}, context_len {ctx_len}"
                    f" and {len(table)} blocks disagree"
                )
        if not 0 <= batch.num_decodes <= count:
            raise ValueError(f"num_decodes {batch.num_decodes} is not between 0 and {count} sequences")
        if any(q_len != 1 for q_len in batch.query_lens[: batch.num_decodes]):
            raise ValueError("the first num_decodes sequences must have query length 1")
        if (backend or attention_backend(device, dtype, head_dim)) == "kernel":
            if not kernel_available():
                raise RuntimeError("the paged attention kernel could not be built (see the log)")
            return cls(
                decodes=[],
                prefills=[],
                scale=head_dim**-0.5,
                kernel=KernelBatch.from_batch(batch, block_size),
            )
        decodes = _plan_decodes(batch, block_size, device, dtype)
        prefills = []
        start = batch.num_decodes
        for seq in range(batch.num_decodes, count):
            prefills.append(_plan_prefill(batch, seq, start, block_size, device))
            start += batch.query_lens[seq]
        return cls(decodes=decodes, prefills=prefills, scale=head_dim**-0.5)


def attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``$WEIR_ATTENTION`` (``kernel`` by default, or ``reference``), falling back to the reference where the
    kernel does not run: not a CPU step in fp32 or bf16, a head size it is not compiled for, or a machine
    where it could not be built."""
    chosen = os.environ.get(ATTENTION_ENV, "kernel")
    if chosen not in BACKENDS:
        raise ValueError(f"{ATTENTION_ENV} must be one of {', '.join(BACKENDS)}, got {chosen!r}")
    if chosen == "kernel" and kernel_supports(device, dtype, head_dim) and kernel_available():
        return "kernel"
    return "reference"


def _plan_decodes(
    batch: StepBatch, block_size: int, device: torch.device, dtype: torch.dtype
) -> list[DecodeGroup]:
    blocks_needed = [-(-ctx // block_size) for ctx in batch.context_lens[: batch.num_decodes]]
    order = sorted(range(batch.num_decodes), key=blocks_needed.__getitem__)
    groups = []
    start = 0
    for end in _group_ends([blocks_needed[i] for i in order], block_size):
        members = order[start:end]
        groups.append(_decode_group(batch, members, blocks_needed[members[-1]], block_size, device, dtype))
        start = end
    return groups


def _group_ends(sorted_blocks: list[int], block_size: int) -> list[int]:
    """Group ends over decodes sorted by length minimising padded tokens plus a cost per group (DP)."""
    count = len(sorted_blocks)
    if count == 0:
        return []
    # candidate cut positions: after the last sequence of each distinct length, thinned to a bounded number
    cuts = [i + 1 for i in range(count) if i + 1 == count or sorted_blocks[i + 1] != sorted_blocks[i]]
    if len(cuts) > MAX_GROUP_BOUNDARIES:
        step = len(cuts) / MAX_GROUP_BOUNDARIES
        cuts = sorted({cuts[int(k * step)] for k in range(MAX_GROUP_BOUNDARIES)} | {count})
    best = [0.0] + [float("inf")] * len(cuts)  # best[j]: cost of covering the first cuts[j - 1] sequences
    back = [0] * (len(cuts) + 1)
    for j, end in enumerate(cuts, start=1):
        padded = sorted_blocks[end - 1] * block_size
        for i in range(j):
            begin = cuts[i - 1] if i else 0
            cost = best[i] + (end - begin) * padded + GROUP_COST_TOKENS
            if cost < best[j]:
                best[j], back[j] = cost, i
    ends, j = [], len(cuts)
    while j:
        ends.append(cuts[j - 1])
        j = back[j]
    return ends[::-1]


def _decode_group(
    batch: StepBatch,
    members: list[int],
    blocks_per_seq: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecodeGroup:
    padded = [batch.block_tables[i][:blocks_per_seq] for i in members]
    padded = [table + [0] * (blocks_per_seq - len(table)) for table in padded]
    padded_len = blocks_per_seq * block_size
    context_lens = [batch.context_lens[i] for i in members]
    mask = None
    if any(ctx != padded_len for ctx in context_lens):
        lens = torch.tensor(context_lens, device=device).unsqueeze(1)
        valid = torch.arange(padded_len, device=device).unsqueeze(0) < lens
        mask = torch.zeros(len(members), padded_len, device=device, dtype=dtype).masked_fill_(
            ~valid, float("-inf")
        )
        mask = mask.view(len(members), 1, 1, padded_len)
    return DecodeGroup(
        rows=torch.tensor(members, dtype=torch.int64, device=device),
        count=len(members),
        block_ids=torch.tensor(padded, dtype=torch.int64, device=device).flatten(),
        padded_len=padded_len,
        mask=mask,
    )


def _plan_prefill(
    batch: StepBatch, seq: int, start: int, block_size: int, device: torch.device
) -> PrefillPlan:
    length, context_len = batch.query_lens[seq], batch.context_lens[seq]
    if context_len == length:
        return PrefillPlan(start=start, length=length, context_len=context_len, block_ids=None, mask=None)
    blocks = batch.block_tables[seq][: -(-context_len // block_size)]
    query_pos = torch.arange(context_len - length, context_len, device=device).unsqueeze(1)
    mask = torch.arange(context_len, device=device).unsqueeze(0) <= query_pos
    return PrefillPlan(
        start=start,
        length=length,
        context_len=context_len,
        block_ids=torch.tensor(blocks, dtype=torch.int64, device=device),
        mask=mask,
    )


class GatherBuffers:
    """Reusable memory for gathered keys and values, grown on demand and kept across layers and steps."""

    def __init__(self) -> None:
        self._keys = torch.empty(0)
        self._values = torch.empty(0)

    def gather(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed blocks' keys and values, in order, each [len(block_ids) * block_size, kv_heads, dim]."""
        num_slots, kv_heads, head_dim = key_cache.shape
        row = block_size * kv_heads * head_dim
        needed = block_ids.numel() * row
        if self._keys.numel() < needed or self._keys.dtype != key_cache.dtype:
            self._keys = key_cache.new_empty(needed)
            self._values = value_cache.new_empty(needed)
        out = []
        for cache, buffer in ((key_cache, self._keys), (value_cache, self._values)):
            blocks = buffer[:needed].view(block_ids.numel(), row)
            torch.index_select(cache.view(num_slots // block_size, row), 0, block_ids, out=blocks)
            out.append(blocks.view(-1, kv_heads, head_dim))
        return out[0], out[1]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    plan: AttentionPlan,
    buffers: GatherBuffers,
) -> torch.Tensor:
    """Attention output [T, heads * head_dim] for the step's queries ``q`` [T, heads, head_dim].

    ``k``/``v`` [T, kv_heads, head_dim] are the step's own keys and values, already written to the caches.
    """
    if plan.kernel is not None:
        return plan.kernel.attend(q, key_cache, value_cache, plan.scale)
    # the reference: gathered context and SDPA
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = key_cache.shape[1]
    group_size = num_heads // kv_heads
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for group in plan.decodes:
        keys, values = buffers.gather(key_cache, value_cache, group.block_ids, block_size)
        keys = keys.view(group.count, group.padded_len, kv_heads, head_dim).transpose(1, 2)
        values = values.view(group.count, group.padded_len, kv_heads, head_dim).transpose(1, 2)
        grouped_q = q.index_select(0, group.rows).view(group.count, kv_heads, group_size, head_dim)
        result = F.scaled_dot_product_attention(
            grouped_q, keys, values, attn_mask=group.mask, scale=plan.scale
        )
        out.index_copy_(0, group.rows, result.reshape(group.count, num_heads * head_dim))
    for chunk in plan.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        if chunk.block_ids is None:
            keys, values = k[rows], v[rows]
        else:
            keys, values = buffers.gather(key_cache, value_cache, chunk.block_ids, block_size)
            keys, values = keys[: chunk.context_len], values[: chunk.context_len]
        keys = keys.transpose(0, 1).unsqueeze(0)
        values = values.transpose(0, 1).unsqueeze(0)
        result = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=plan.scale,
            enable_gqa=group_size > 1,
        )
        out[rows].view(chunk.length, num_heads, head_dim).copy_(result.squeeze(0).transpose(0, 1))
    return out
