"""The contract between the scheduler and the model: one engine step, all tokens flattened."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepBatch:
    """Every token the model runs in one step, as one flat batch.

    Sequences are ordered decodes first (query length 1), then prefill chunks. For sequence ``i`` the step
    holds tokens ``[query_starts[i], query_starts[i] + query_lens[i])`` of the flat arrays; after the step its
    cache holds ``context_lens[i]`` tokens (positions ``0 .. context_lens[i] - 1``), the step's own included,
    in the blocks ``block_tables[i]`` (block ``b`` holds positions ``b*block_size .. (b+1)*block_size - 1``).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE position of each token
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot (block_id * block_size + offset) to write K/V into
    query_lens: list[int]  # per sequence: tokens in this step
    context_lens: list[int]  # per sequence: tokens in the cache after this step
    block_tables: list[list[int]]  # per sequence: its block ids in order
    logits_indices: torch.Tensor  # [S] int64, rows of T whose next-token logits are needed
    num_decodes: int  # the first num_decodes sequences have query length 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_lists(
        cls,
        *,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        logits_indices: list[int],
        device: torch.device,
    ) -> StepBatch:
        """A batch from plain lists (decodes first), its index tensors made on ``device``."""

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slot_mapping),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            logits_indices=tensor(logits_indices),
            num_decodes=sum(1 for n in query_lens if n == 1),
        )


@dataclass
class KVCacheTensors:
    """The paged KV memory: per layer, K and V of shape [num_blocks * block_size, num_kv_heads, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
