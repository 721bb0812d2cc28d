"""Which replica holds which KV block: the router's in-memory prefix index.

Two kinds of entries per replica:
- confirmed: block hashes the replica itself reported (KV events and snapshots from Redis);
- of the confirmed, ``host``: those the replica keeps in its second KV tier (host memory): a hit
  there costs a copy back up, less than a prefill but more than a tier-1 hit;
- predicted: hashes of prompts the router just sent there, kept until the replica confirms
  them (stored) or refutes them (removed), or they expire. Prefill takes a while; without these,
  a burst of requests sharing a new prefix would scatter before the first one's blocks are
  reported. A replica reports a prompt's blocks once its prefill is done, which on a slow or
  queued fleet takes longer than any fixed time: so a prediction lives ``prediction_ttl_s``, at
  least the floor it was built with and stretched (``stretch``) to a multiple of the slowest
  confirmation the router is waiting for or has recently seen (docs/router.md, "Predictions").
  Without Redis (``kvscale up`` with no redis-server) predictions are all the router has, so
  they then live until evicted by a per-replica capacity.

Only the router's event loop touches an index, so it has no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvscale.kv_index_schema import TIER_HOST


@dataclass
class _ReplicaBlocks:
    confirmed: set[int] = field(default_factory=set)
    host: set[int] = field(default_factory=set)  # the confirmed ones held in tier 2
    predicted: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> when predicted
    seq: int = 0  # last event sequence number applied (from the replica's publisher)


# A prediction outlives the slowest confirmation in sight by this factor: a request still queued
# when its prediction was made keeps it until its prefill is done and its blocks reported.
PREDICTION_LATENCY_FACTOR = 2.0


def prediction_ttl(floor_s: float, latency_s: float, factor: float = PREDICTION_LATENCY_FACTOR) -> float:
    """How long a prediction lives: the floor, or ``factor`` times ``latency_s`` (how long the
    router has waited, or recently waited, for a prefill to be done) when that is longer."""
    return max(floor_s, factor * max(latency_s, 0.0))


class PrefixIndex:
    def __init__(self, prediction_ttl_s: float = 10.0, prediction_capacity: int = 65536) -> None:
        self.prediction_floor_s = prediction_ttl_s
        self.prediction_ttl_s = prediction_ttl_s
        self.prediction_capacity = prediction_capacity
        self._replicas: dict[str, _ReplicaBlocks] = {}

    # -- updates from replicas' KV events ---------------------------------------------------
    def _blocks(self, replica_id: str) -> _ReplicaBlocks:
        blocks = self._replicas.get(replica_id)
        if blocks is None:
            blocks = self._replicas[replica_id] = _ReplicaBlocks()
        return blocks

    def stored(self, replica_id: str, block_hashes: Iterable[int], tier: int = 1) -> None:
        blocks = self._blocks(replica_id)
        for block_hash in block_hashes:
            blocks.confirmed.add(block_hash)
            blocks.predicted.pop(block_hash, None)
            if tier == TIER_HOST:
                blocks.host.add(block_hash)
            else:
                blocks.host.discard(block_hash)

    def removed(self, replica_id: str, block_hashes: Iterable[int]) -> None:
        """Gone from a tier; a block lives in one tier at a time, so from the replica (a move
        between tiers is this followed by ``stored`` in the other one)."""
        blocks = self._blocks(replica_id)
        for block_hash in block_hashes:
            blocks.confirmed.discard(block_hash)
            blocks.host.discard(block_hash)
            blocks.predicted.pop(block_hash, None)

    def cleared(self, replica_id: str) -> None:
        blocks = self._blocks(replica_id)
        blocks.confirmed.clear()
        blocks.host.clear()
        blocks.predicted.clear()

    def replace(self, replica_id: str, block_hashes: Iterable[int], seq: int) -> None:
        """A full snapshot: what the replica holds as of event ``seq`` (tiers unknown: tier 1)."""
        blocks = self._blocks(replica_id)
        blocks.confirmed = set(block_hashes)
        blocks.host = set()
        blocks.seq = seq

    def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def seq(self, replica_id: str) -> int:
        blocks = self._replicas.get(replica_id)
        return blocks.seq if blocks else 0

    def set_seq(self, replica_id: str, seq: int) -> None:
        self._blocks(replica_id).seq = seq

    # -- predictions from the router's own decisions ------------------------------------------
    def stretch(self, latency_s: float) -> None:
        """The slowest prefill the router waits for, or recently waited for: every prediction,
        made earlier or later, lives ``prediction_ttl(floor, latency_s)`` from when it was made."""
        self.prediction_ttl_s = prediction_ttl(self.prediction_floor_s, latency_s)

    def predict(self, replica_id: str, block_hashes: Sequence[int], now: float) -> None:
        blocks = self._blocks(replica_id)
        for block_hash in block_hashes:
            if block_hash in blocks.confirmed:
                continue
            blocks.predicted[block_hash] = now
            blocks.predicted.move_to_end(block_hash)
        while len(blocks.predicted) > self.prediction_capacity:
            blocks.predicted.popitem(last=False)

    def _holds(self, blocks: _ReplicaBlocks, block_hash: int, now: float) -> bool:
        if block_hash in blocks.confirmed:
            return True
        predicted_at = blocks.predicted.get(block_hash)
        if predicted_at is None:
            return False
        if now - predicted_at > self.prediction_ttl_s:
            del blocks.predicted[block_hash]
            return False
        return True

    # -- lookups -------------------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int], replica_ids: Iterable[str], now: float) -> dict[str, int]:
        """For each replica, how many *leading* blocks of the prompt it holds."""
        matched: dict[str, int] = {}
        for replica_id in replica_ids:
            blocks = self._replicas.get(replica_id)
            count = 0
            if blocks is not None:
                for block_hash in block_hashes:
                    if not self._holds(blocks, block_hash, now):
                        break
                    count += 1
            matched[replica_id] = count
        return matched

    def match_host(self, block_hashes: Sequence[int], matched: dict[str, int]) -> dict[str, int]:
        """For each replica, how many of its ``matched`` leading blocks sit in its host tier."""
        out: dict[str, int] = {}
        for replica_id, count in matched.items():
            blocks = self._replicas.get(replica_id)
            host = blocks.host if blocks is not None else set()
            out[replica_id] = sum(1 for h in block_hashes[:count] if h in host) if host else 0
        return out

    def confirmed_view(self, replica_id: str) -> AbstractSet[int]:
        """The blocks the replica reported holding: the index's own set, not a copy (read it only)."""
        blocks = self._replicas.get(replica_id)
        return blocks.confirmed if blocks else frozenset()

    def confirmed_blocks(self, replica_id: str) -> set[int]:
        blocks = self._replicas.get(replica_id)
        return set(blocks.confirmed) if blocks else set()

    def sizes(self) -> dict[str, int]:
        return {rid: len(b.confirmed) for rid, b in self._replicas.items()}

    def replica_ids(self) -> list[str]:
        return list(self._replicas)
