"""The paged KV cache's bookkeeping: a ref-counted block allocator, per-sequence block tables, and the
prefix cache.

The tensors themselves (``engine.batch.KVCacheTensors``) are made by the model; this module only decides
which block holds which sequence's tokens. Blocks are allocated as tokens arrive and returned the moment a
sequence finishes, is aborted or is preempted.

Prefix cache: once a block is full of computed tokens, it is registered under a hash of its tokens and of
every token before it (a chain, salted per tenant), so a later sequence whose tokens start the same way
shares the block instead of computing it again. A returned block that holds a registered hash keeps its
contents: it counts as free, and is reused by a matching sequence or, least recently used first, taken for
new tokens when no empty block is left.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator


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
    """Hands out block ids from a fixed pool; a block returns to the pool when its ref count drops to 0.

    A returned block with a prefix hash stays findable by that hash until it is taken for other tokens.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the pool needs at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its prefix hash
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a prefix hash (in use or free)."""
        return len(self._by_hash)

    def ref_count(self, block: int) -> int:
        """The tables holding ``block`` (a prefix-cache block can be in several)."""
        return self._ref_counts[block]

    def allocate(self) -> int:
        """Take a block: an empty one, else the least recently used cached one (its hash forgotten)."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        else:
            raise RuntimeError("no free KV block")
        self._ref_counts[block] = 1
        return block

    def release(self, block: int) -> None:
        """Drop one reference; the block is free again when none is left."""
        if self._ref_counts[block] < 1:
            raise ValueError(f"block {block} is already free")
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, prefix_hash: bytes) -> None:
        """Make an allocated, full block findable by ``prefix_hash`` (no-op if that hash has a block)."""
        if prefix_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[prefix_hash] = block
            self._hash_of[block] = prefix_hash

    def holds(self, prefix_hash: bytes) -> bool:
        """Whether a block is registered under ``prefix_hash`` (no reference taken)."""
        return prefix_hash in self._by_hash

    def lookup(self, prefix_hash: bytes) -> int | None:
        """Take a reference to the block registered under ``prefix_hash``, if there is one."""
        block = self._by_hash.get(prefix_hash)
        if block is None:
            return None
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1
        return block


def chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The prefix hash of a block holding ``tokens`` after the blocks whose hash is ``parent``."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class KVCacheManager:
    """Block tables of the sequences that hold KV memory, keyed by request id; callers get copies."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError("block size must be positive")
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.allocator = BlockAllocator(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # per sequence: the hash chain of its full blocks

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
        have = len(self._tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def table(self, request_id: str) -> list[int]:
        """The blocks holding the sequence's tokens, in order (empty for a sequence that holds none)."""
        return list(self._tables.get(request_id, ()))

    def grow(self, request_id: str, num_tokens: int) -> bool:
        """Extend the table to cover ``num_tokens`` tokens; False (and nothing taken) if blocks are short."""
        needed = self.blocks_needed(request_id, num_tokens)
        if needed > self.allocator.num_free:
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self.allocator.allocate() for _ in range(needed))
        return True

    def free(self, request_id: str) -> None:
        """Return all of the sequence's blocks (no-op for a sequence that holds none)."""
        self._hashes.pop(request_id, None)
        for block in self._tables.pop(request_id, ()):
            self.allocator.release(block)

    def share_prefix(self, request_id: str, token_ids: list[int], salt: str) -> int:
        """Give a sequence that holds no blocks yet the cached blocks its tokens start with; returns how
        many tokens they hold. The block of the last token is never shared: that token is always computed
        (its logits are needed), and a shared block is never written."""
        if not self.prefix_caching or request_id in self._tables:
            return 0
        table: list[int] = []
        hashes: list[bytes] = []
        for prefix_hash in self._shareable_hashes(token_ids, salt):
            block = self.allocator.lookup(prefix_hash)
            if block is None:
                break
            table.append(block)
            hashes.append(prefix_hash)
        if table:
            self._tables[request_id] = table
            self._hashes[request_id] = hashes
        return len(table) * self.block_size

    def cached_prefix_tokens(self, token_ids: list[int], salt: str) -> int:
        """How many leading tokens of a new sequence ``share_prefix`` would give it now, taking nothing (the
        engine thread may change the cache right after: an estimate)."""
        if not self.prefix_caching:
            return 0
        held = 0
        for prefix_hash in self._shareable_hashes(token_ids, salt):
            if not self.allocator.holds(prefix_hash):
                break
            held += self.block_size
        return held

    def _shareable_hashes(self, token_ids: list[int], salt: str) -> Iterator[bytes]:
        """The prefix hashes of ``token_ids``' full blocks, but the block of the last token (never shared)."""
        size = self.block_size
        parent = salt.encode()
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            parent = chain_hash(parent, token_ids[start : start + size])
            yield parent

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int, salt: str) -> None:
        """Register the sequence's blocks that are full of computed tokens and not registered yet."""
        if not self.prefix_caching:
            return
        size = self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        table = self._tables.get(request_id, [])
        parent = hashes[-1] if hashes else salt.encode()
        for index in range(len(hashes), min(num_computed // size, len(table))):
            parent = chain_hash(parent, token_ids[index * size : (index + 1) * size])
            self.allocator.register(table[index], parent)
            hashes.append(parent)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat KV slots of the sequence's positions ``start .. end - 1``."""
        table = self._tables[request_id]
        size = self.block_size
        return [table[pos // size] * size + pos % size for pos in range(start, end)]
