"""Block pool: reference counts, fresh-before-cached allocation, LRU eviction, KV events."""

from __future__ import annotations

import pytest

from kvscale.server.core.block_pool import BlockPool, NoFreeBlocksError
from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored


def test_allocate_and_free_counts():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(), pool.allocate()
    assert a != b and pool.num_free_blocks == 2 and pool.num_active_blocks == 2
    pool.touch(a)
    pool.free([a])
    assert pool.blocks[a].ref_count == 1 and pool.num_free_blocks == 2
    pool.free([a, b])
    assert pool.num_free_blocks == 4 and pool.num_active_blocks == 0


def test_double_free_is_an_error():
    pool = BlockPool(2, 16)
    a = pool.allocate()
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])


def test_exhaustion_raises():
    pool = BlockPool(1, 16)
    pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_cached_blocks_survive_free_and_are_found_again():
    pool = BlockPool(4, 16)
    a = pool.allocate()
    pool.register_full_block(a, 111, None)
    pool.free([a])
    assert pool.num_cached_free_blocks == 1
    assert pool.lookup(111) == a
    pool.touch(a)  # a prefix hit revives it
    assert pool.blocks[a].ref_count == 1 and pool.num_cached_free_blocks == 0
    pool.free([a])


def test_fresh_blocks_are_used_before_evicting_cached_ones():
    pool = BlockPool(3, 16)
    a = pool.allocate()
    pool.register_full_block(a, 1, None)
    pool.free([a])
    b, c = pool.allocate(), pool.allocate()
    assert a not in (b, c), "a cached block was evicted while fresh blocks were left"
    assert pool.lookup(1) == a
    pool.drain_events()
    d = pool.allocate()  # only the cached one is left: now it goes
    assert d == a and pool.lookup(1) is None
    assert pool.drain_events() == [BlockRemoved([1])]
    pool.free([b, c, d])


def test_lru_eviction_order():
    pool = BlockPool(3, 16)
    ids = [pool.allocate() for _ in range(3)]
    for i, block_id in enumerate(ids):
        pool.register_full_block(block_id, 100 + i, None)
    pool.free([ids[1]])
    pool.free([ids[0]])
    pool.free([ids[2]])
    # Least recently freed first: ids[1], then ids[0], then ids[2].
    assert pool.allocate() == ids[1]
    assert pool.allocate() == ids[0]
    pool.touch(ids[2])  # a hit moves it out of the LRU
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()


def test_events_and_duplicates():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(), pool.allocate()
    pool.register_full_block(a, 7, None)
    pool.register_full_block(b, 8, 7)
    other = pool.allocate()
    pool.register_full_block(other, 7, None)  # same content computed twice: first copy wins
    assert pool.lookup(7) == a and pool.blocks[other].block_hash is None
    assert pool.drain_events() == [BlockStored([7], None, 16), BlockStored([8], 7, 16)]
    assert sorted(pool.cached_hashes()) == [7, 8]
    pool.free([other])
    assert pool.num_cached_free_blocks == 0  # an unregistered block goes back as fresh
    assert not pool.reset_prefix_cache(), "reset must refuse while blocks are held"
    pool.free([b, a])
    assert pool.reset_prefix_cache()
    assert pool.drain_events() == [AllBlocksCleared()]
    assert pool.lookup(7) is None and pool.num_free_blocks == 4


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, 16, enable_caching=False)
    a = pool.allocate()
    pool.register_full_block(a, 5, None)
    assert pool.lookup(5) is None and pool.drain_events() == []
    pool.free([a])
