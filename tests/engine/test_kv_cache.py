"""Block allocator and block tables of the paged KV cache."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockAllocator, KVCacheManager, num_blocks_for_memory


def test_memory_budget_gives_whole_blocks_and_rejects_too_small() -> None:
    assert num_blocks_for_memory(10 * 1000 + 999, 1000) == 10
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_memory(999, 1000)


def test_ref_counted_block_returns_to_pool_only_when_last_reference_goes() -> None:
    allocator = BlockAllocator(2)
    a, b = allocator.allocate(), allocator.allocate()
    assert {a, b} == {0, 1} and allocator.num_free == 0
    with pytest.raises(RuntimeError, match="no free KV block"):
        allocator.allocate()
    allocator.register(a, b"prefix")
    assert allocator.lookup(b"prefix") == a  # a second reference, as a shared prefix block takes
    allocator.release(a)
    assert allocator.num_free == 0 and allocator.ref_count(a) == 1
    allocator.release(a)
    assert allocator.num_free == 1 and allocator.ref_count(a) == 0
    with pytest.raises(ValueError, match="already free"):
        allocator.release(a)


def test_tables_grow_as_tokens_arrive_and_map_positions_to_slots() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.grow("a", 5)  # two blocks
    assert kv.blocks_needed("a", 8) == 0 and kv.blocks_needed("a", 9) == 1
    assert kv.grow("b", 4)
    table_a, table_b = kv.table("a"), kv.table("b")
    assert len(table_a) == 2 and len(table_b) == 1 and not set(table_a) & set(table_b)
    assert kv.slots("a", 3, 6) == [table_a[0] * 4 + 3, table_a[1] * 4, table_a[1] * 4 + 1]
    assert not kv.grow("b", 13)  # needs 3 more, only 1 free: nothing is taken
    assert kv.num_free_blocks == 1 and len(kv.table("b")) == 1
    kv.free("a")
    kv.free("a")  # freeing a sequence without blocks is a no-op
    assert kv.num_free_blocks == 3 and not kv.table("a")
