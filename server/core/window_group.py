"""The sliding-window layers' KV-cache group: their blocks in a pool of their own, one table per
sequence, and every block wholly before what the sequence's next query reads handed back to the
pool as the sequence advances (docs/engine.md, "Sliding-window layers' KV blocks").

A sequence's ``window_table`` is indexed as its ``block_table`` is (entry i holds positions
``i * block_size`` on); its first ``window_freed`` entries are FREED and never read again: a query
at position p reads the keys at p - window + 1 .. p only (window_attention.py), a sequence's next
position only grows, and a preempted sequence starts again from no blocks at all.

The group shares the full-attention group's block hashes: a window block is registered under the
same hash as the full group's block of the same positions, and a prefix hit needs, besides every
full-group block of the prefix, only the window blocks its next query reads (``hit_blocks``).
"""

from __future__ import annotations

from kvscale.server.core.block_pool import BlockPool, blocks_for
from kvscale.server.core.sequence import Sequence

FREED = -1  # a window_table entry whose block went back to the pool


def first_kept_block(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position``, and every later one, reads."""
    return max(0, position - window + 1) // block_size


def blocks_per_sequence(window: int, block_size: int, num_new_tokens: int = 1) -> int:
    """The most window blocks one sequence holds while a step adds ``num_new_tokens`` tokens: the
    window behind its first new token, the new tokens, and a block each end may straddle."""
    return blocks_for(window - 1 + num_new_tokens, block_size) + 1


class WindowGroup:
    def __init__(self, pool: BlockPool, window: int) -> None:
        if window < 1:
            raise ValueError(f"a sliding window must be at least one token, got {window}")
        self.pool = pool
        self.window = window
        self.block_size = pool.block_size
        # (source block, destination block) copy-on-write copies for the window layers' cache.
        self.pending_copies: list[tuple[int, int]] = []

    def release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks that no query from its next position on reads."""
        table = seq.window_table
        first = min(first_kept_block(seq.num_computed_tokens, self.window, self.block_size), len(table))
        if first <= seq.window_freed:
            return
        self.pool.free(table[seq.window_freed:first])  # oldest first: evicted first
        table[seq.window_freed:first] = [FREED] * (first - seq.window_freed)
        seq.window_freed = first

    def hit_blocks(self, block_hashes: list[int], num_blocks: int) -> list[int] | None:
        """The pool's blocks a prefix of ``num_blocks`` cached blocks needs in this group (those
        its next query reads), or None when one of them is not cached."""
        found = []
        for block_hash in block_hashes[first_kept_block(num_blocks * self.block_size, self.window,
                                                        self.block_size):num_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                return None
            found.append(block_id)
        return found

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        pos = seq.num_computed_tokens
        idx = pos // self.block_size
        table = seq.window_table
        return (pos % self.block_size != 0 and idx < len(table) and table[idx] != FREED
                and self.pool.blocks[table[idx]].ref_count > 1)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None,
                      num_hit_blocks: int = 0) -> int:
        """Free blocks of this group that scheduling ``num_new_tokens`` more tokens of ``seq``
        consumes (``hits``: the window blocks of a prefix hit of ``num_hit_blocks`` blocks)."""
        bs = self.block_size
        if hits is not None:
            total = blocks_for(num_hit_blocks * bs + num_new_tokens, bs)
            revived = sum(1 for b in hits if self.pool.blocks[b].ref_count == 0)
            return max(total - num_hit_blocks, 0) + revived
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, bs)
        return max(total - len(seq.window_table), 0) + self._needs_copy_on_write(seq)

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None,
                 num_hit_blocks: int = 0) -> None:
        """Grow ``seq``'s window table so its next ``num_new_tokens`` tokens have slots, after a
        prefix hit first taking ``hits`` (the manager has set ``num_computed_tokens``)."""
        pool = self.pool
        if hits is not None:
            assert not seq.window_table, "prefix hits apply only to a sequence without blocks"
            for block_id in hits:
                pool.touch(block_id)
            seq.window_freed = num_hit_blocks - len(hits)
            seq.window_table = [FREED] * seq.window_freed + hits
        if self._needs_copy_on_write(seq):
            pool.copy_on_write(seq.window_table, seq.num_computed_tokens // self.block_size, self.pending_copies)
        total = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.window_table) < total:
            seq.window_table.append(pool.allocate())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for block_id in parent.window_table[parent.window_freed:]:
            self.pool.touch(block_id)
        child.window_table = list(parent.window_table)
        child.window_freed = parent.window_freed

    def free(self, seq: Sequence) -> None:
        held = seq.window_table[seq.window_freed:]
        if held:
            self.pool.free(held[::-1])
        seq.window_table = []
        seq.window_freed = 0

    def register(self, seq: Sequence, index: int, block_hash: int, parent: int | None,
                 token_ids: tuple[int, ...], lora_name: str | None) -> None:
        """Make block ``index`` of ``seq``'s window table findable (a no-op once freed)."""
        if index < len(seq.window_table) and seq.window_table[index] != FREED:
            self.pool.register_full_block(seq.window_table[index], block_hash, parent, token_ids, lora_name)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        # The full group's pool publishes the KV events of a hash (kv_publisher.py); this one's
        # are dropped, so a router's index never counts a hash twice.
        self.pool.drain_events()
        copies, self.pending_copies = self.pending_copies, []
        return copies
