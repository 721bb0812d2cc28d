"""The blocks this router sent each replica recently, in the order sent: the room its hot prefixes
take there (a new prefix should evict none of them), the room its recent traffic claims, and how
much of a prefix the replica's LRU keeps once what was sent since is in (docs/router.md, "Where a
new prefix goes", "what the holder will still hold")."""

from __future__ import annotations

from collections import OrderedDict

# A block routed to a replica twice within this long is hot there: a new prefix should not evict
# it. The floor; on a slow fleet the window stretches with the prefill wait (HOT_LATENCY_FACTOR).
HOT_WINDOW_S = 30.0
# A slow fleet reuses a prefix less often per second, not less: the window spans this many prefill
# waits (docs/router.md, "Room for new prefixes").
HOT_LATENCY_FACTOR = 4.0
# At most this many block hashes remembered per replica (a busy router's 30 s can hold millions).
HOT_BLOCKS_KEPT = 262_144
# How far back ``HotBlocks.kept`` looks for a prefix among the blocks sent since it, per holder: a
# prefix further back on a replica with more blocks than that is taken as kept (a step a block, and
# a decision's time is what a router adds to every request).
KEPT_LOOKBACK = 4_096


class HotBlocks:
    """Per replica, the prompt blocks this router sent there at least twice within ``HOT_WINDOW_S``:
    the KV room its hot prefixes take, so that a cold prompt goes where it evicts none of them.
    (A block sent once is a unique suffix, or a prefix not yet reused: LRU may take it.)"""

    def __init__(self, window_s: float = HOT_WINDOW_S, capacity: int = HOT_BLOCKS_KEPT) -> None:
        self.window_floor_s = window_s
        self.window_s = window_s
        self.capacity = capacity
        # replica -> block hash -> (last sent, times sent, sends to the replica then), oldest first
        self._sent: dict[str, OrderedDict[int, tuple[float, int, int]]] = {}
        self._sends: dict[str, int] = {}  # replica -> blocks sent there so far, repeats and all
        self._hot: dict[str, int] = {}  # replica -> how many of its entries were sent twice or more

    def stretch(self, latency_s: float) -> None:
        """The slowest prefill in sight (as ``PrefixIndex.stretch``): the window spans
        HOT_LATENCY_FACTOR of them, at least its floor."""
        self.window_s = max(self.window_floor_s, HOT_LATENCY_FACTOR * max(latency_s, 0.0))

    def sent(self, replica_id: str, hashes: list[int], now: float) -> None:
        blocks = self._sent.setdefault(replica_id, OrderedDict())
        self._expire(replica_id, now)
        sends = self._sends.get(replica_id, 0)
        for block_hash in hashes:
            _, times, _ = blocks.get(block_hash, (0.0, 0, 0))
            if times == 1:
                self._hot[replica_id] = self._hot.get(replica_id, 0) + 1
            sends += 1
            blocks[block_hash] = (now, times + 1, sends)
            blocks.move_to_end(block_hash)
        self._sends[replica_id] = sends
        while len(blocks) > self.capacity:
            _, (_, times, _) = blocks.popitem(last=False)
            if times >= 2:
                self._hot[replica_id] -= 1

    def _expire(self, replica_id: str, now: float) -> None:
        blocks = self._sent.get(replica_id)
        cutoff = now - self.window_s
        while blocks and next(iter(blocks.values()))[0] < cutoff:
            _, (_, times, _) = blocks.popitem(last=False)
            if times >= 2:
                self._hot[replica_id] -= 1

    def footprint(self, replica_id: str, now: float) -> int:
        self._expire(replica_id, now)
        return self._hot.get(replica_id, 0)

    def recent(self, replica_id: str, now: float) -> int:
        """Distinct blocks sent to the replica within the window, once or more: the room its
        recent traffic claims (a new prefix goes where that is least)."""
        self._expire(replica_id, now)
        return len(self._sent.get(replica_id, ()))

    def kept(self, replica_id: str, hashes: list[int], matched: int, kv_blocks: int) -> int | None:
        """Of the ``matched`` leading blocks of ``hashes`` on the replica, the ones its LRU keeps
        once the distinct blocks this router sent there since are in: those more recent than the
        prefix's last block take the first places of its ``kv_blocks``, the prefix the rest, its
        tail going first (the engine frees a sequence's blocks tail first). None where that is
        unknown: no size, no match, the prefix not sent there within the window, or further back
        than KEPT_LOOKBACK blocks on a replica with more blocks than that."""
        blocks = self._sent.get(replica_id)
        last = hashes[matched - 1] if 0 < matched <= len(hashes) else None
        entry = blocks.get(last) if blocks and last is not None else None
        if kv_blocks <= 0 or blocks is None or entry is None:
            return None
        # Every block newer than the prefix was sent after it: fewer sends than free places, no walk.
        if min(len(blocks), self._sends[replica_id] - entry[2]) <= kv_blocks - matched:
            return matched
        lookback = min(kv_blocks, KEPT_LOOKBACK)
        newer = 0
        for block_hash in reversed(blocks):
            if block_hash == last:
                break
            newer += 1
            if newer >= lookback:
                return 0 if lookback == kv_blocks else None
        return max(0, min(matched, kv_blocks - newer))

    def forget(self, replica_id: str) -> None:
        self._sent.pop(replica_id, None)
        self._hot.pop(replica_id, None)
        self._sends.pop(replica_id, None)


def free_blocks(kv_blocks_total: int, hot_blocks: int) -> int | None:
    """KV room a cold prompt may take without evicting a hot prefix; None when the size is unknown."""
    return max(kv_blocks_total - hot_blocks, 0) if kv_blocks_total > 0 else None


__all__ = ["HOT_BLOCKS_KEPT", "KEPT_LOOKBACK", "HOT_LATENCY_FACTOR", "HOT_WINDOW_S", "HotBlocks", "free_blocks"]
