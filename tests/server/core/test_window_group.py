"""The sliding-window KV group's blocks: freed as a sequence passes them, found again by a prefix
hit only with the blocks its next query reads, shared by a fork (server/core/window_group.py)."""

from __future__ import annotations

from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.core.window_group import (
    FREED,
    WindowGroup,
    blocks_per_sequence,
    first_kept_block,
)
from kvscale.server.outputs import RequestMetrics
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.kv_groups import kv_groups, split_budget

BS, WINDOW = 4, 8


def _seq(tokens: list[int]) -> Sequence:
    request = Request("r", None, tokens, SamplingParams(), None, RequestMetrics(0.0), 16)
    return Sequence(request, 0, list(tokens), len(tokens))


def _manager(full: int = 32, window: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(full, BS), True, WindowGroup(BlockPool(window, BS), WINDOW))


def _advance(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    assert kv.allocate_if_room(seq, n)
    kv.register_full_blocks(seq, seq.num_computed_tokens + n)
    seq.num_computed_tokens += n


def test_the_first_block_a_query_reads() -> None:
    assert first_kept_block(0, WINDOW, BS) == 0
    assert first_kept_block(8, WINDOW, BS) == 0  # keys 1..8: block 0 still
    assert first_kept_block(11, WINDOW, BS) == 1  # keys 4..11
    assert blocks_per_sequence(WINDOW, BS) == 3  # 8 keys may straddle three blocks of four
    assert blocks_per_sequence(WINDOW, BS, 16) == 7


def test_groups_only_for_models_mixing_full_and_one_window() -> None:
    groups = kv_groups([8, None, 8])
    assert groups is not None and (groups.window, groups.full_layers, groups.window_layers) == (8, (1,), (0, 2))
    assert kv_groups([None, None]) is None and kv_groups([8, 8]) is None and kv_groups([8, 4, None]) is None


def test_budget_split_gives_the_window_what_it_needs_and_the_full_group_the_rest() -> None:
    assert split_budget(1000, 10, 5, 20, 4) == (90, 20)
    assert split_budget(100, 10, 5, 20, 4) == (5, 10)  # at most half the budget ...
    assert split_budget(20, 10, 5, 20, 4) == (0, 4)  # ... and never under one sequence's need


def test_blocks_behind_the_window_go_back_as_the_sequence_decodes() -> None:
    kv = _manager()
    seq = _seq(list(range(1, 10)))
    _advance(kv, seq, 9)  # a 9-token prefill: three blocks in each group
    window = kv.window
    assert window is not None and len(seq.window_table) == 3
    for _ in range(40):
        seq.token_ids.append(7)
        _advance(kv, seq, 1)
        assert window.pool.num_active_blocks <= blocks_per_sequence(WINDOW, BS)
    assert len(seq.block_table) == -(-49 // BS) == kv.pool.num_active_blocks
    assert seq.window_table[:seq.window_freed] == [FREED] * seq.window_freed
    assert seq.window_freed == first_kept_block(48, WINDOW, BS)
    kv.free(seq)
    assert window.pool.num_active_blocks == 0 and seq.window_table == []


def test_a_prefix_hit_needs_the_window_blocks_of_its_last_tokens() -> None:
    kv = _manager()
    window = kv.window
    assert window is not None
    tokens = list(range(1, 26))
    first = _seq(tokens)
    for _ in range(6):
        _advance(kv, first, 4)
    kv.free(first)
    # The window blocks freed on the way stay cached until evicted: the whole prefix is found.
    second = _seq(tokens)
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 6
    # Evict the window block holding positions 16..19: a prefix of 6 blocks (next query at 24, keys
    # 17..24) needs it, a prefix of 4 blocks (next query at 16, keys 9..16) does not.
    evicted = window.pool.lookup(second.block_hashes[4])
    assert evicted is not None
    window.pool._cached_free.move_to_end(evicted, last=False)
    window.pool._fresh.clear()
    window.pool.allocate()
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 4
    assert kv.can_allocate(second, 9, hits)
    kv.allocate(second, 9, hits)
    assert second.num_computed_tokens == 16
    assert second.window_freed == first_kept_block(16, WINDOW, BS) == 2
    assert second.window_table[2:4] == [window.pool.lookup(h) for h in second.block_hashes[2:4]]
    assert len(second.window_table) == -(-25 // BS)


def test_a_fork_shares_window_blocks_and_copies_the_partial_one_on_write() -> None:
    kv = _manager()
    window = kv.window
    assert window is not None
    parent = _seq(list(range(1, 15)))
    _advance(kv, parent, 14)
    child = _seq(list(parent.token_ids))
    kv.fork(parent, child)
    shared = parent.window_table[-1]
    assert window.pool.blocks[shared].ref_count == 2
    child.token_ids.append(3)
    _advance(kv, child, 1)
    copies = kv.take_pending_window_copies()
    assert copies == [(shared, child.window_table[3])] and child.window_table[3] != shared
    assert window.pool.blocks[shared].ref_count == 1
    kv.free(parent)
    kv.free(child)
    assert window.pool.num_active_blocks == 0
