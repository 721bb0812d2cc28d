"""The host tier's copies: slot runs, and a demote/promote round trip in the slot-major layout.

The GPU path (DMA per run of slots on a copy stream) is checked on a GPU by
``python -m bench.gpu_engine --parts tier``, which verifies every promoted and demoted byte.
"""

from __future__ import annotations

import torch

from kvscale.server.core.block_pool import TierCopies
from kvscale.server.core.kv_offload import HostKVCache, slot_runs


def test_slot_runs_split_where_the_slots_stop_being_consecutive() -> None:
    assert slot_runs([]) == []
    assert slot_runs([4]) == [(0, 4, 1)]
    assert slot_runs([4, 5, 6, 2, 3, 9, 8]) == [(0, 4, 3), (3, 2, 2), (5, 9, 1), (6, 8, 1)]
    assert slot_runs([0, 1, 1, 2]) == [(0, 0, 2), (2, 1, 2)]


def test_demote_then_promote_moves_whole_blocks_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    # [layer, k|v, block, offset, kv_head, head_dim], as the runner allocates it.
    cache = torch.randn((3, 2, 12, 4, 2, 8), generator=gen).to(torch.bfloat16)
    original = cache.clone()
    tier = HostKVCache(10, cache)
    assert tier.num_slots == 10 and tier.block_bytes == 3 * 2 * 4 * 2 * 8 * 2
    demote = [(7, 3), (2, 4), (5, 5), (11, 0)]  # a run of three slots, then one more
    tier.run(cache, TierCopies(demote=demote))
    for block, slot in demote:
        assert torch.equal(tier.host[slot], original[:, :, block])
    cache[:, :, [0, 1, 6, 9]] = 0
    promote = [(4, 0), (3, 9), (0, 1), (5, 6)]  # (slot, block)
    tier.run(cache, TierCopies(promote=promote))
    back = {slot: block for block, slot in demote}
    for slot, block in promote:
        assert torch.equal(cache[:, :, block], original[:, :, back[slot]])
    assert tier.counters.bytes_down == tier.counters.bytes_up == 4 * tier.block_bytes
    assert tier.counters.restore_count == 1
