"""The second KV tier's bookkeeping: which host slot holds which block hash, in LRU order.

Tier 2 is exclusive: a hash lives in tier 1 (the block pool) or here, never both. Blocks come
down when tier 1 evicts them (demotion) and go up when a prefix lookup hits them (promotion);
when every slot is taken the least recently demoted or hit hash is dropped for good.

A promoted slot is not free at once: its copy up runs with the step's batch of copies, and in
that batch demotions run first (they must read tier-1 blocks before promotions overwrite them),
so a slot handed back during scheduling could be overwritten before it is read. Such slots wait
in ``_releasing`` until the engine takes the step's copies (``release``). This module holds no
tensors; ``server/core/kv_offload.py`` moves the bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    slot: int
    parent_hash: int | None
    token_ids: tuple[int, ...] = ()  # what its KV event carries (server/outputs.py BlockStored)
    lora_name: str | None = None


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # hash -> entry, LRU first
        self._releasing: list[int] = []

    # --- counts -------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Slots holding a findable block."""
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_releasing(self) -> int:
        return len(self._releasing)

    def has_room(self) -> bool:
        """A slot is free, or one can be freed by dropping the LRU hash."""
        return bool(self._free or self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    # --- moves --------------------------------------------------------------------------
    def put(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...] = (),
            lora_name: str | None = None) -> tuple[int, int | None]:
        """A slot for a block coming down, and the hash dropped to make room (None if none).

        Call only when ``has_room`` (every slot may be waiting for its promotion's copy).
        """
        assert block_hash not in self._entries, "tier 2 is exclusive: the hash is already here"
        dropped = None
        if not self._free:
            dropped, entry = self._entries.popitem(last=False)
            self._free.append(entry.slot)
        slot = self._free.pop()
        self._entries[block_hash] = HostEntry(slot, parent_hash, token_ids, lora_name)
        return slot, dropped

    def take(self, block_hash: int) -> HostEntry:
        """Remove a hash for promotion; its slot is reusable only after ``release``."""
        entry = self._entries.pop(block_hash)
        self._releasing.append(entry.slot)
        return entry

    def discard(self, block_hash: int) -> bool:
        """Forget a hash whose content tier 1 has just computed again (one copy per block)."""
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self._free.append(entry.slot)
        return True

    def touch(self, block_hash: int) -> None:
        """A lookup saw it: it becomes the most recently used."""
        self._entries.move_to_end(block_hash)

    def release(self) -> None:
        """The step's copies are handed to the runner: promoted slots may be reused from now."""
        self._free.extend(self._releasing)
        self._releasing.clear()

    def clear(self) -> list[int]:
        """Drop every hash (prefix cache reset); returns them."""
        dropped = list(self._entries)
        for entry in self._entries.values():
            self._free.append(entry.slot)
        self._entries.clear()
        return dropped
