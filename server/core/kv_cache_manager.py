"""Per-sequence block tables on top of the block pool: prefix hits, growth, forks, copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import NamedTuple

from kvscale.block_hash import first_block_keys, hash_block_tokens
from kvscale.server.core.block_pool import TIER_DEVICE, TIER_HOST, BlockPool, TierCopies, blocks_for
from kvscale.server.core.sequence import Sequence
from kvscale.server.core.window_group import WindowGroup


class PrefixHit(NamedTuple):
    """One cached block of a prefix: in tier 1 (``block_id`` is the pool's) or tier 2 (-1)."""

    tier: int
    block_id: int
    block_hash: int




class KVCacheManager:
    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True,
                 window: WindowGroup | None = None) -> None:
        self.pool = pool
        # The sliding-window layers' group, where the model has one (window_group.py): ``pool``
        # then holds the full-attention layers' blocks only.
        self.window = window
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        # (source block, destination block) copies the runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.host_cache_queries = 0  # tokens looked up in tier 2 (those tier 1 did not hold)
        self.host_cache_hits = 0  # tokens found there (promoted)

    # --- hashing ------------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> None:
        hashes = seq.block_hashes
        bs = self.block_size
        first = first_block_keys(seq.request.cache_salt, seq.request.lora_name)
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            extra = first if i == 0 else ()
            hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs : (i + 1) * bs], extra))

    def find_cached_prefix(self, seq: Sequence) -> list[PrefixHit]:
        """The longest cached prefix of ``seq`` (not yet referenced), block by block, each hit
        found in tier 1 first, else in tier 2 (the host tier, when there is one).

        At least one token is always left to compute, since its logits are needed; so a
        prompt that is cached in full recomputes its last block.
        """
        if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's logits: no skipping
        max_blocks = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, max_blocks)
        hits: list[PrefixHit] = []
        pool = self.pool
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = pool.lookup(block_hash)
            if block_id is not None:
                hits.append(PrefixHit(TIER_DEVICE, block_id, block_hash))
            elif pool.lookup_host(block_hash):
                hits.append(PrefixHit(TIER_HOST, -1, block_hash))
            else:
                break
        window = self.window
        while hits and window is not None and window.hit_blocks(seq.block_hashes, len(hits)) is None:
            hits.pop()  # the window layers' blocks for the last tokens of this prefix are gone
        return hits

    # --- allocation ---------------------------------------------------------------------
    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next token lands in a partial block another sequence also holds."""
        pos = seq.num_computed_tokens
        idx = pos // self.block_size
        return (
            pos % self.block_size != 0
            and idx < len(seq.block_table)
            and self.pool.blocks[seq.block_table[idx]].ref_count > 1
        )

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: Seq[PrefixHit] = ()) -> int:
        """Free blocks that scheduling ``num_new_tokens`` more tokens of ``seq`` consumes."""
        if cached:
            num_computed = len(cached) * self.block_size
            held = len(cached)
            # Reviving a cached-but-free block takes it out of the free queue; a tier-2 hit
            # takes a free block to be promoted into.
            blocks = self.pool.blocks
            revived = sum(1 for h in cached if h.tier == TIER_HOST or blocks[h.block_id].ref_count == 0)
        else:
            num_computed = seq.num_computed_tokens
            held = len(seq.block_table)
            revived = 0
        total = blocks_for(num_computed + num_new_tokens, self.block_size)
        cow = 1 if (not cached and self._needs_copy_on_write(seq)) else 0
        return max(total - held, 0) + cow + revived

    def _window_hits(self, seq: Sequence, cached: Seq[PrefixHit]) -> list[int] | None:
        if not cached or self.window is None:
            return None
        hits = self.window.hit_blocks(seq.block_hashes, len(cached))
        assert hits is not None, "find_cached_prefix keeps only prefixes the window group holds"
        return hits

    def _window_fits(self, seq: Sequence, num_new_tokens: int, cached: Seq[PrefixHit]) -> bool:
        window = self.window
        if window is None:
            return True
        needed = window.blocks_needed(seq, num_new_tokens, self._window_hits(seq, cached), len(cached))
        return needed <= window.pool.num_free_blocks

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[PrefixHit] = ()) -> bool:
        return (self.num_blocks_needed(seq, num_new_tokens, cached) <= self.pool.num_free_blocks
                and self._window_fits(seq, num_new_tokens, cached))

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: Seq[PrefixHit] = ()) -> None:
        """Grow ``seq``'s table so its next ``num_new_tokens`` tokens have slots."""
        pool = self.pool
        if cached:
            assert not seq.block_table, "prefix hits apply only to a sequence without blocks"
            # Tier-1 hits are referenced and tier-2 hits reserved before anything is allocated:
            # the allocations below may evict (and demote), and must not take one of these.
            for hit in cached:
                if hit.tier == TIER_DEVICE:
                    pool.touch(hit.block_id)
            from_host = [h.block_hash for h in cached if h.tier == TIER_HOST]
            reserved = iter(pool.reserve_host(from_host) if from_host else [])
            table = []
            for hit in cached:
                if hit.tier == TIER_DEVICE:
                    table.append(hit.block_id)
                else:
                    table.append(pool.promote(hit.block_hash, next(reserved)))
            seq.block_table = table
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.num_registered_blocks = len(cached)
        if self._needs_copy_on_write(seq):
            pool.copy_on_write(seq.block_table, seq.num_computed_tokens // self.block_size, self.pending_copies)
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(pool.allocate())
        if self.window is not None:
            self.window.allocate(seq, num_new_tokens, self._window_hits(seq, cached), len(cached))

    def allocate_if_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """``can_allocate`` then ``allocate`` for a sequence that holds its blocks (a running one:
        no prefix hits), counting once; False, with nothing changed, when the pool lacks the
        blocks. The scheduler asks this of every running sequence every step, and most need
        nothing (their slots are in blocks they hold)."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        window_needed = 0
        if self.window is not None:
            self.window.release(seq)  # what no query of this step or later reads goes back first
            window_needed = self.window.blocks_needed(seq, num_new_tokens)
            if window_needed > self.window.pool.num_free_blocks:
                return False
        if not needed and not window_needed:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        self.allocate(seq, num_new_tokens)
        return True

    def record_lookup(self, seq: Sequence, num_hit_tokens: int, hits: Seq[PrefixHit] = ()) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            if self.pool.host is not None:
                from_device = sum(1 for h in hits if h.tier == TIER_DEVICE) * self.block_size
                self.host_cache_queries += seq.num_tokens - from_device
                self.host_cache_hits += num_hit_tokens - from_device

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write happens on its first write)."""
        for block_id in parent.block_table:
            self.pool.touch(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        if self.window is not None:
            self.window.fork(parent, child)

    def free(self, seq: Sequence, swap_out: bool = False) -> None:
        """Drop ``seq``'s blocks; with ``swap_out`` its registered blocks nobody else holds are
        demoted at once (a preempted sequence resumes from tier 2 instead of recomputing)."""
        table = seq.block_table
        if table:
            self.pool.free(table[::-1])
            if swap_out:
                self.pool.demote_blocks(table[: seq.num_registered_blocks])
        seq.block_table = []
        seq.num_registered_blocks = 0
        if self.window is not None:
            self.window.free(seq)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Make every block of ``seq`` that is full within its first ``num_tokens`` tokens findable.

        The scheduler calls this with the tokens a step will have computed, before the step runs
        (as vLLM v1 does): every layer writes the whole batch's K/V before any attention reads it,
        so a sequence admitted later in the same step, or in any later step, can share blocks that
        are still being filled instead of prefilling the same prefix again. Aborts and preemptions
        happen only between steps, so a registered block is always computed by the time it is read.
        """
        if not self.enable_prefix_caching or num_tokens // self.block_size <= seq.num_registered_blocks:
            return  # the second: no block newly full (most decode steps)
        # A placeholder's id is not known yet (async_scheduling.py): the block it fills waits a step.
        num_full = min(num_tokens, seq.num_known_tokens) // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, num_full)
        tokens, size, lora_name = seq.token_ids, self.block_size, seq.request.lora_name
        for i in range(seq.num_registered_blocks, num_full):
            parent = seq.block_hashes[i - 1] if i else None
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            self.pool.register_full_block(seq.block_table[i], seq.block_hashes[i], parent, block_tokens, lora_name)
            if self.window is not None:
                self.window.register(seq, i, seq.block_hashes[i], parent, block_tokens, lora_name)
        seq.num_registered_blocks = num_full

    def take_tier_copies(self) -> TierCopies:
        """Copies between the tiers for the next forward (demotions, then promotions)."""
        return self.pool.take_tier_copies()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def take_pending_window_copies(self) -> list[tuple[int, int]]:
        """The window layers' copy-on-write copies (their own cache); none without a window group."""
        return self.window.take_pending_copies() if self.window is not None else []
