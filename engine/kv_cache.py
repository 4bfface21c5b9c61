"""The paged KV cache's bookkeeping: a ref-counted block allocator and per-sequence block tables.

The tensors themselves (``engine.batch.KVCacheTensors``) are made by the model; this module only decides
which block holds which sequence's tokens. Blocks are allocated as tokens arrive and returned the moment a
sequence finishes, is aborted or is preempted. Ref counts let a later prefix cache share full blocks.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    """The pool has no free block left."""


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    """How many blocks a memory budget holds; at least one block must fit."""
    if bytes_per_block <= 0:
        raise ValueError("bytes per block must be positive")
    num_blocks = memory_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv cache memory of {memory_bytes} bytes holds no block (a block takes {bytes_per_block} bytes)"
        )
    return num_blocks


class BlockAllocator:
    """Hands out block ids from a fixed pool; a block returns to the pool when its ref count drops to 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocksError("no free KV block")
        block = self._free.popleft()
        self._ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """Take one more reference to an allocated block."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._ref_counts[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is already free")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free.append(block)


class KVCacheManager:
    """Block tables of the sequences that hold KV memory, keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError("block size must be positive")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_blocks * self.block_size

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks the sequence needs so that its table covers ``num_tokens`` tokens."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Extend the table to cover ``num_tokens`` tokens; False (and nothing taken) if blocks are short."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > self.allocator.num_free:
            return False
        table = self.block_tables.setdefault(request_id, [])
        table.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def free(self, request_id: str) -> None:
        """Return all of the sequence's blocks (no-op for a sequence that holds none)."""
        for block in self.block_tables.pop(request_id, ()):
            self.allocator.release(block)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat KV slots of the sequence's positions ``start .. end - 1``."""
        table = self.block_tables[request_id]
        size = self.block_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]
