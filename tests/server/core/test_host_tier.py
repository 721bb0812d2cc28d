"""The second KV tier's bookkeeping and decisions, without a model: host slots, demotion on
eviction, promotion on a prefix hit, exclusivity, events with their tier, swap-or-recompute."""

from __future__ import annotations

import pytest

from kvscale.server.core.block_pool import TIER_DEVICE, TIER_HOST, BlockPool
from kvscale.server.core.host_tier import HostTier
from kvscale.server.core.kv_cache_manager import KVCacheManager
from kvscale.server.core.kv_tier_policy import (
    blocks_to_demote_ahead,
    swap_is_cheaper,
    watermark_blocks,
)
from kvscale.server.core.scheduler import Scheduler
from kvscale.server.core.sequence import Request, Sequence
from kvscale.server.outputs import BlockRemoved, BlockStored, RequestMetrics
from kvscale.server.sampling_params import SamplingParams
from kvscale.server.worker.kv_sizing import host_memory_room, host_tier_blocks

BS = 4


def make_seq(tokens: list[int], name: str = "r") -> Sequence:
    request = Request(name, None, tokens, SamplingParams(max_tokens=4), None, RequestMetrics(0.0), 4)
    seq = Sequence(request, 0, list(tokens), len(tokens))
    request.seqs.append(seq)
    return seq


def tiered(num_blocks: int, num_slots: int) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, BS, True, HostTier(num_slots))
    return pool, KVCacheManager(pool)


def fill(kv: KVCacheManager, tokens: list[int], name: str = "r") -> Sequence:
    """Admit a sequence as the scheduler would, compute it, and finish it (blocks stay cached)."""
    seq = make_seq(tokens, name)
    hits = kv.find_cached_prefix(seq)
    kv.allocate(seq, len(tokens) - len(hits) * BS, hits)
    kv.register_full_blocks(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    kv.free(seq)
    return seq


# --- HostTier ------------------------------------------------------------------------------
def test_host_tier_drops_least_recently_used_when_full():
    tier = HostTier(2)
    assert tier.put(10, None) == (0, None)
    assert tier.put(11, 10) == (1, None)
    slot, dropped = tier.put(12, 11)
    assert (slot, dropped) == (0, 10) and 10 not in tier and 12 in tier and tier.num_cached == 2


def test_host_tier_promoted_slot_is_reused_only_after_release():
    tier = HostTier(1)
    slot, _ = tier.put(10, None)
    assert tier.take(10).slot == slot
    assert tier.num_free == 0 and tier.num_releasing == 1 and not tier.has_room()
    tier.release()
    assert tier.put(11, None) == (slot, None)


# --- the pool with a tier --------------------------------------------------------------------
def test_eviction_demotes_and_a_hit_promotes_with_one_copy_each_way():
    pool, kv = tiered(4, 8)
    a = fill(kv, list(range(12)), "a")  # 3 full blocks, all registered
    assert pool.num_cached_free_blocks == 3
    pool.drain_events()
    fill(kv, list(range(100, 116)), "b")  # needs 4 blocks: one fresh, a's 3 cached ones demoted
    copies = kv.take_tier_copies()
    assert len(copies.demote) == 3 and not copies.promote
    assert pool.num_demoted == 3 and pool.host is not None and pool.host.num_cached == 3
    assert {h for h in a.block_hashes} <= set(pool.cached_hashes_by_tier()[TIER_HOST])
    events = pool.drain_events()
    stored_host = [e for e in events if isinstance(e, BlockStored) and e.tier == TIER_HOST]
    assert sorted(h for e in stored_host for h in e.block_hashes) == sorted(a.block_hashes)
    # a's parents travel with their hashes, so the router can chain them.
    parents = {e.block_hashes[0]: e.parent_block_hash for e in stored_host}
    assert parents[a.block_hashes[1]] == a.block_hashes[0]

    again = make_seq(list(range(12)) + [1], "a2")
    hits = kv.find_cached_prefix(again)
    assert [h.tier for h in hits] == [TIER_HOST] * 3
    kv.allocate(again, 1, hits)
    copies = kv.take_tier_copies()
    assert [b for _, b in copies.promote] == again.block_table[:3]
    # Promotion needed blocks: b's cached ones went down; a's hashes live in tier 1 only now.
    assert all(pool.lookup(h) is not None and h not in pool.host for h in a.block_hashes)
    assert len(copies.demote) == 4  # b's blocks, demoted in the same batch (they run first)
    kv.free(again)


def test_demotions_that_the_same_step_would_reuse_never_overwrite_a_slot_being_promoted():
    pool, kv = tiered(3, 3)
    fill(kv, list(range(8)), "a")
    fill(kv, list(range(100, 112)), "b")  # a demoted into 2 of the 3 slots
    kv.take_tier_copies()
    seq = make_seq(list(range(8)) + [1], "a2")
    hits = kv.find_cached_prefix(seq)
    assert [h.tier for h in hits] == [TIER_HOST, TIER_HOST]
    kv.allocate(seq, 1, hits)  # 3 blocks: b's 3 are demoted, but 2 slots wait for promotion
    copies = kv.take_tier_copies()
    promoted_slots = {s for s, _ in copies.promote}
    assert len(promoted_slots) == 2 and copies.demote
    assert not promoted_slots & {s for _, s in copies.demote}
    kv.free(seq)


def test_tier_one_recompute_of_a_demoted_hash_keeps_one_copy():
    pool, kv = tiered(2, 4)
    a = fill(kv, list(range(8)), "a")
    fill(kv, list(range(100, 108)), "b")
    assert pool.host is not None and a.block_hashes[0] in pool.host
    kv.take_tier_copies()
    pool.drain_events()
    # A request that takes no cache hits computes the same block again in tier 1.
    seq = make_seq(list(range(8)), "c")
    kv.allocate(seq, 8)
    kv.register_full_blocks(seq, 8)
    assert a.block_hashes[0] not in pool.host and pool.lookup(a.block_hashes[0]) is not None
    removed = [e for e in pool.drain_events() if isinstance(e, BlockRemoved) and e.tier == TIER_HOST]
    assert a.block_hashes[0] in {h for e in removed for h in e.block_hashes}
    kv.free(seq)


def test_counts_return_to_baseline_and_reset_clears_both_tiers():
    pool, kv = tiered(3, 3)
    for i in range(5):
        fill(kv, list(range(i * 100, i * 100 + 12)), f"s{i}")
        kv.take_tier_copies()
    assert pool.num_active_blocks == 0 and pool.host is not None
    assert pool.host.num_cached + pool.host.num_free == 3 and pool.host.num_releasing == 0
    assert pool.reset_prefix_cache()
    assert pool.host.num_free == 3 and pool.cached_hashes() == []


def test_demote_ahead_keeps_the_watermark_of_fresh_blocks():
    pool, kv = tiered(4, 8)
    fill(kv, list(range(16)), "a")
    assert pool.num_fresh_blocks == 0
    assert pool.demote_ahead(blocks_to_demote_ahead(pool.num_fresh_blocks, pool.num_cached_free_blocks, 2)) == 2
    assert pool.num_fresh_blocks == 2 and len(kv.take_tier_copies().demote) == 2


def test_preempted_sequence_swaps_out_and_resumes_from_tier_two():
    pool, kv = tiered(6, 16)
    scheduler = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.block_bytes = 1000
    old = make_seq(list(range(16)), "old")
    scheduler.add(old)
    scheduler.schedule()
    old.num_computed_tokens = 16
    new = make_seq(list(range(200, 208)), "new")
    scheduler.add(new)
    scheduler.schedule()
    new.num_computed_tokens = 8
    # old grows into a fifth block, new into a third: 7 > 6, so new (the newest) is preempted.
    old.token_ids += [1]
    new.token_ids += [2] * 4
    out = scheduler.schedule()
    assert out.preempted == [new] and scheduler.num_swapped_out == 1
    copies = kv.take_tier_copies()
    assert len(copies.demote) == 2  # new's two full blocks went down at once
    hits = kv.find_cached_prefix(new)
    assert [h.tier for h in hits] == [TIER_HOST, TIER_HOST]


# --- decisions -------------------------------------------------------------------------------
def test_watermark_and_demote_ahead_rules():
    assert watermark_blocks(1000) == 20 and watermark_blocks(10) == 1 and watermark_blocks(10, 0) == 0
    assert blocks_to_demote_ahead(num_fresh=5, num_cached_free=100, watermark=20) == 15
    assert blocks_to_demote_ahead(num_fresh=5, num_cached_free=3, watermark=20) == 3
    assert blocks_to_demote_ahead(num_fresh=30, num_cached_free=100, watermark=20) == 0


def test_swap_or_recompute_picks_the_cheaper_from_measured_rates():
    block = 737 * 1024
    # 10 blocks, 160 tokens: swap moves 2 x 7.4 MB; at 5 GB/s that is 3 ms, prefill at 2k tok/s 80 ms.
    assert swap_is_cheaper(10, block, 160, copy_bytes_per_s=5e9, prefill_tokens_per_s=2000)
    # A slow link and a fast device: recompute.
    assert not swap_is_cheaper(10, block, 160, copy_bytes_per_s=1e6, prefill_tokens_per_s=1e5)
    assert swap_is_cheaper(10, block, 160, copy_bytes_per_s=0, prefill_tokens_per_s=2000)  # unmeasured
    assert not swap_is_cheaper(0, block, 3, copy_bytes_per_s=5e9, prefill_tokens_per_s=2000)


def test_host_tier_sizing_and_its_errors():
    gib = 1024**3
    assert host_tier_blocks(0, 1000, host_room_bytes=0, host_room_what="x") == 0
    assert host_tier_blocks(1, 1024**2, host_room_bytes=2 * gib, host_room_what="x") == 1024
    with pytest.raises(ValueError, match=r"--kv-offloading-size 4 GiB plus the 1.00 GiB KV cache"):
        host_tier_blocks(4, 1024**2, host_room_bytes=3 * gib, host_room_what="MemAvailable", other_host_bytes=gib)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        host_tier_blocks(1e-9, 1024**2, host_room_bytes=gib, host_room_what="x")


def test_host_tier_size_is_the_total_over_the_tensor_parallel_ranks():
    """vLLM's meaning of --kv-offloading-size at TP > 1: the ranks share it, each in slots of its
    own heads' block; only the ranks on this machine count against its memory."""
    gib, mib = 1024**3, 1024**2
    # 1 GiB over 4 ranks: 256 MiB a rank, 256 slots of 1 MiB each (the pool's blocks: one slot
    # holds a block on every rank).
    assert host_tier_blocks(1, mib, host_room_bytes=gib // 2, host_room_what="x", ranks=4, ranks_here=2) == 256
    with pytest.raises(ValueError, match=r"4 GiB \(2 of its 2 ranks' shares on this machine\) needs 4.00 GiB"):
        host_tier_blocks(4, mib, host_room_bytes=3 * gib, host_room_what="x", ranks=2, ranks_here=2)
    # The other node holds the other rank's share: this machine needs half.
    assert host_tier_blocks(4, mib, host_room_bytes=3 * gib, host_room_what="x", ranks=2, ranks_here=1) == 2048
    with pytest.raises(ValueError, match=r"over 2 tensor-parallel ranks is smaller than one KV block"):
        host_tier_blocks(1.5 * mib / gib, mib, host_room_bytes=gib, host_room_what="x", ranks=2)


def test_host_memory_room_reads_the_cgroup_limit_when_it_is_lower(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(str(2 * 1024**3) + "\n")
    (cgroup / "memory.current").write_text(str(1024**3) + "\n")
    room, what = host_memory_room(str(meminfo), str(cgroup))
    assert room == 1024**3 and "memory.max" in what
    (cgroup / "memory.max").write_text("max\n")
    room, what = host_memory_room(str(meminfo), str(cgroup))
    assert room == 4000000 * 1024 and "MemAvailable" in what


def test_host_memory_room_reads_a_cgroup_v1_limit_too(tmp_path):
    """Many Kubernetes nodes still mount cgroup v1: a pod's limit must count there as well."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    memory = tmp_path / "cg" / "memory"
    memory.mkdir(parents=True)
    (memory / "memory.limit_in_bytes").write_text(str(2 * 1024**3) + "\n")
    (memory / "memory.usage_in_bytes").write_text(str(1024**3 + 512 * 1024**2) + "\n")
    room, what = host_memory_room(str(meminfo), str(tmp_path / "cg"))
    assert room == 512 * 1024**2 and "memory.limit_in_bytes" in what
    # Inactive page cache (the checkpoint read at load) is reclaimed before an OOM kill.
    (memory / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {256 * 1024**2}\n")
    room, _ = host_memory_room(str(meminfo), str(tmp_path / "cg"))
    assert room == 768 * 1024**2
    (memory / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    room, what = host_memory_room(str(meminfo), str(tmp_path / "cg"))
    assert room == 4000000 * 1024 and "MemAvailable" in what


def test_tier_hits_are_reported_by_tier():
    pool, kv = tiered(2, 4)
    a = fill(kv, list(range(8)), "a")
    fill(kv, list(range(100, 104)), "b")  # one block: evicts (demotes) a's oldest
    seq = make_seq(list(range(8)) + [1])
    tiers = [h.tier for h in kv.find_cached_prefix(seq)]
    assert TIER_HOST in tiers and tiers.count(TIER_DEVICE) + tiers.count(TIER_HOST) == 2
    assert a.block_hashes[0] in pool.cached_hashes()
