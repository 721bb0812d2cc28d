"""The KV block pool: reference counts, the prefix-cache map and the LRU of reusable blocks.

A block is in exactly one of three states:
  - held (ref_count > 0) by one or more sequences;
  - free and cached: ref_count == 0 but it still holds a full block whose hash is in the
    prefix-cache map, so a later request with the same prefix can take it back;
  - free and fresh: holds nothing anyone can find.
Fresh blocks are handed out first; a cached block is evicted (its hash dropped, least recently
freed first) only when no fresh block is left.

With a second tier (``host_tier.HostTier``) an evicted cached block is demoted instead of
dropped: its hash moves to a host slot and the (block, slot) copy is queued, to run before the
next forward writes the block again. A tier-2 hit is promoted into a freshly allocated block the
same way, in the other direction. The pool queues copies; the runner does them, demotions first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvscale.kv_index_schema import TIER_DEVICE, TIER_HOST
from kvscale.server.core.host_tier import HostEntry, HostTier
from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["TIER_DEVICE", "TIER_HOST", "BlockPool", "KVBlock", "NoFreeBlocksError", "TierCopies"]


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache
    parent_hash: int | None = None  # the previous block's hash (a demotion's event needs it)
    token_ids: tuple[int, ...] = ()  # its tokens and adapter, for its KV events (outputs.BlockStored)
    lora_name: str | None = None


@dataclass
class TierCopies:
    """A step's copies between the tiers, in the order they must run: demotions, then promotions."""

    demote: list[tuple[int, int]] = field(default_factory=list)  # (tier-1 block, host slot)
    promote: list[tuple[int, int]] = field(default_factory=list)  # (host slot, tier-1 block)

    def __bool__(self) -> bool:
        return bool(self.demote or self.promote)


class NoFreeBlocksError(RuntimeError):
    pass


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks ``num_tokens`` tokens fill, the last one partly."""
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, host: HostTier | None = None
    ) -> None:
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
        self.host = host if enable_caching else None
        self._copies = TierCopies()
        self.num_demoted = 0  # cumulative blocks copied down
        self.num_promoted = 0  # cumulative blocks copied up
        # Blocks registered since the engine started a log (step_undo.py): a step given up
        # before its KV was computed makes them unfindable again. None: no log kept.
        self.registration_log: list[int] | None = None

    # --- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (fresh plus evictable cached)."""
        return len(self._fresh) + len(self._cached_free)

    @property
    def num_fresh_blocks(self) -> int:
        return len(self._fresh)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_active_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # --- prefix cache -------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def lookup_host(self, block_hash: int) -> bool:
        """Whether tier 2 holds the hash (no side effect: the stats call this too; a hit that is
        used leaves tier 2 at once, so its LRU position no longer matters)."""
        return self.host is not None and block_hash in self.host

    def cached_hashes(self) -> list[int]:
        """Every hash this replica can serve a prefix hit from, in either tier."""
        hashes = list(self._hash_to_block)
        if self.host is not None:
            hashes += self.host.hashes()
        return hashes

    def cached_hashes_by_tier(self) -> dict[int, list[int]]:
        return {TIER_DEVICE: list(self._hash_to_block), TIER_HOST: self.host.hashes() if self.host else []}

    def register_full_block(self, block_id: int, block_hash: int, parent_hash: int | None,
                            token_ids: tuple[int, ...] = (), lora_name: str | None = None) -> None:
        """Make a just-filled block findable by its hash (a no-op if that content is cached already)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._hash_to_block:
            return  # the same content computed twice concurrently: keep the first copy
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        block.lora_name = lora_name
        self._hash_to_block[block_hash] = block_id
        if self.registration_log is not None:
            self.registration_log.append(block_id)
        if self.host is not None and self.host.discard(block_hash):
            # Computed again above (a request that skips the cache): one copy per block.
            self._events.append(BlockRemoved([block_hash], tier=TIER_HOST))
        self._events.append(BlockStored([block_hash], parent_hash, self.block_size,
                                        token_ids=token_ids, lora_name=lora_name))

    def forget_hashes(self, block_ids: list[int]) -> None:
        """Make blocks registered before their KV was computed unfindable again (a step given up
        mid-forward, step_undo.py): a later request must not hit what nobody computed. Their
        holders keep them; freed, they are fresh."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            del self._hash_to_block[block.block_hash]
            self._events.append(BlockRemoved([block.block_hash]))
            block.block_hash, block.parent_hash, block.token_ids, block.lora_name = None, None, (), None

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

    def copy_on_write(self, table: list[int], index: int, pending_copies: list[tuple[int, int]]) -> None:
        """Give ``table`` a block of its own at ``index``, where it shares a partly filled block that
        its next token would write: a fresh block, the copy (shared, fresh) queued in
        ``pending_copies`` for the worker to run before the step, the shared one released."""
        shared = table[index]
        private = self.allocate()
        pending_copies.append((shared, private))
        self.free([shared])
        table[index] = private

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
            block_hash = block.block_hash
            del self._hash_to_block[block_hash]
            self._events.append(BlockRemoved([block_hash]))
            block.block_hash = None
            if self.host is None:
                self.num_evicted += 1
            else:
                self._demote(block_id, block_hash, block.parent_hash)
            block.token_ids, block.lora_name = (), None

    # --- the second tier ----------------------------------------------------------------
    def _demote(self, block_id: int, block_hash: int, parent_hash: int | None) -> None:
        assert self.host is not None
        if not self.host.has_room():
            # Every host slot waits for this step's promotions to be copied: drop, never wait.
            self.num_evicted += 1
            return
        block = self.blocks[block_id]
        slot, dropped = self.host.put(block_hash, parent_hash, block.token_ids, block.lora_name)
        if dropped is not None:
            self._events.append(BlockRemoved([dropped], tier=TIER_HOST))
            self.num_evicted += 1
        self._events.append(BlockStored([block_hash], parent_hash, self.block_size, tier=TIER_HOST,
                                        token_ids=block.token_ids, lora_name=block.lora_name))
        self._copies.demote.append((block_id, slot))
        self.num_demoted += 1

    def demote_ahead(self, count: int) -> int:
        """Demote up to ``count`` least recently used cached-free blocks now, making them fresh."""
        done = 0
        while done < count and self._cached_free and self.host is not None:
            block_id, _ = self._cached_free.popitem(last=False)
            self._evict(block_id)
            self._fresh.append(block_id)
            done += 1
        return done

    def demote_blocks(self, block_ids: list[int]) -> None:
        """Swap out: demote these just-freed cached blocks now (a preempted sequence's)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0 and block.block_hash is not None and block_id in self._cached_free:
                del self._cached_free[block_id]
                self._evict(block_id)
                self._fresh.append(block_id)

    def reserve_host(self, block_hashes: list[int]) -> list[HostEntry]:
        """Take tier-2 hits out of tier 2 before allocating their tier-1 blocks, so no
        demotion those allocations cause can drop them. Returns each hash's entry (slot, parent)."""
        assert self.host is not None
        return [self.host.take(block_hash) for block_hash in block_hashes]

    def promote(self, block_hash: int, entry: HostEntry) -> int:
        """A fresh tier-1 block (one reference) that will hold a reserved tier-2 block's copy."""
        block_id = self.allocate()
        block = self.blocks[block_id]
        block.block_hash = block_hash
        block.parent_hash = entry.parent_hash
        block.token_ids, block.lora_name = entry.token_ids, entry.lora_name
        self._hash_to_block[block_hash] = block_id
        self._events.append(BlockRemoved([block_hash], tier=TIER_HOST))
        self._events.append(BlockStored([block_hash], entry.parent_hash, self.block_size,
                                        token_ids=entry.token_ids, lora_name=entry.lora_name))
        self._copies.promote.append((entry.slot, block_id))
        self.num_promoted += 1
        return block_id

    def take_tier_copies(self) -> TierCopies:
        """This step's copies between tiers; from now on promoted slots may be reused."""
        copies, self._copies = self._copies, TierCopies()
        if self.host is not None:
            self.host.release()
        return copies

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible while no block is held."""
        if self.num_active_blocks:
            return False
        if self._copies:
            return False  # copies are queued for the next step: let them run first
        for block in self.blocks:
            block.block_hash = None
        self._hash_to_block.clear()
        self._cached_free.clear()
        self._fresh = list(range(self.num_blocks - 1, -1, -1))
        if self.host is not None:
            self.host.clear()
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
