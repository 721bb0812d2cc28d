"""The KV block pool: reference counts, the prefix-cache map and the LRU of reusable blocks.

A block is in exactly one of three states:
  - held (ref_count > 0) by one or more sequences;
  - free and cached: ref_count == 0 but it still holds a full block whose hash is in the
    prefix-cache map, so a later request with the same prefix can take it back;
  - free and fresh: holds nothing anyone can find.
Fresh blocks are handed out first; a cached block is evicted (its hash dropped, least recently
freed first) only when no fresh block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Popped from the end; reversed so block 0 is handed out first (easier to read in tests).
        self._fresh: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: oldest first
        self._hash_to_block: dict[int, int] = {}
        self._events: list[KVEvent] = []
        self.num_evicted = 0  # cumulative: cached prefixes dropped to make room (a metric)

    # --- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (fresh plus evictable cached)."""
        return len(self._fresh) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_active_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # --- prefix cache -------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def cached_hashes(self) -> list[int]:
        return list(self._hash_to_block)

    def register_full_block(self, block_id: int, block_hash: int, parent_hash: int | None) -> None:
        """Make a just-filled block findable by its hash (a no-op if that content is cached already)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._hash_to_block:
            return  # the same content computed twice concurrently: keep the first copy
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        self._events.append(BlockStored([block_hash], parent_hash, self.block_size))

    # --- allocation ---------------------------------------------------------------------
    def allocate(self) -> int:
        """A block nobody holds, with no cached identity; evicts the LRU cached block if needed."""
        if self._fresh:
            block_id = self._fresh.pop()
        elif self._cached_free:
            block_id, _ = self._cached_free.popitem(last=False)
            self._evict(block_id)
        else:
            raise NoFreeBlocksError("no free KV blocks")
        self.blocks[block_id].ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference on a block (a prefix hit or a fork)."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached_free.pop(block_id, None)
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; pass a table tail first so tails are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._cached_free[block_id] = None
                else:
                    self._fresh.append(block_id)

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            self._events.append(BlockRemoved([block.block_hash]))
            self.num_evicted += 1
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible while no block is held."""
        if self.num_active_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()
        self._cached_free.clear()
        self._fresh = list(range(self.num_blocks - 1, -1, -1))
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
