"""The C++ paged attention kernel (``csrc/paged_attention.cpp``): attention that reads the KV blocks in place.

It is built and loaded by ``engine.models.extension`` the first time a CPU step asks for it. When it cannot
be built or loaded, one warning is logged and :func:`kernel_available` is False: attention then takes the
reference gather + SDPA path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.batch import StepBatch
from engine.models.extension import extension_ready

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
NAME = "weir_paged_attention"
DTYPES = (torch.float32, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is compiled for


def kernel_supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs a step on ``device`` in ``dtype``: CPU, fp32 or bf16, a compiled head size."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def kernel_available() -> bool:
    """Build (first time only) and load the extension; False, with a warning logged once, if that fails."""
    what, fallback = "paged attention kernel", "attention falls back to the reference gather + SDPA"
    return extension_ready(NAME, SOURCE, what, fallback)


def matrix_path() -> bool:
    """Whether bf16 prefill chunks take the kernel's matrix path now (bf16 matrix or dot instructions on this
    CPU, oneDNN enabled in torch); False where the kernel is not available."""
    return kernel_available() and bool(torch.ops.weir.paged_attention_matrix_path())


@dataclass(frozen=True)
class KernelBatch:
    """A step's sequences as the kernel reads them (built once per step, used by every layer)."""

    block_tables: torch.Tensor  # [seqs, max_blocks] int32, each row padded with block 0 (never read)
    seqs: torch.Tensor  # [seqs, 3] int32: first row in the flat batch, query length, context length
    block_size: int

    @classmethod
    def from_batch(cls, batch: StepBatch, block_size: int) -> KernelBatch:
        """The kernel's view of ``batch`` (already validated by the attention plan)."""
        blocks = [-(-ctx // block_size) for ctx in batch.context_lens]
        width = max(blocks, default=0)
        tables = [
            block
            for table, count in zip(batch.block_tables, blocks, strict=True)
            for block in itertools.chain(table[:count], itertools.repeat(0, width - count))
        ]
        starts = itertools.accumulate(batch.query_lens, initial=0)
        seqs = [
            value
            for start, q_len, ctx in zip(starts, batch.query_lens, batch.context_lens, strict=False)
            for value in (start, q_len, ctx)
        ]
        count = len(blocks)
        return cls(
            block_tables=torch.tensor(tables, dtype=torch.int32).view(count, width),
            seqs=torch.tensor(seqs, dtype=torch.int32).view(count, 3),
            block_size=block_size,
        )

    def attend(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention output [T, heads * head_dim] for the step's queries ``q`` [T, heads, head_dim]."""
        return torch.ops.weir.paged_attention(
            q, key_cache, value_cache, self.block_tables, self.seqs, self.block_size, scale
        )
