"""One routing decision: the candidates as the policy sees them, the policy's ranking, and the
sessions pinned to a replica.

The ranking itself is ``kvscale.router.policy`` (pure functions); this module gathers its inputs
from the router's state: leading blocks held (the prefix index), load (this router's own
in-flight count raised by the replica's heartbeat), the predicted-TTFT inputs (heartbeat and
prefill ledger), and the replica a session was last sent to.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import replace

from kvscale.router import policy as routing
from kvscale.router.config import RouterConfig
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.lora_routing import replica_affinity
from kvscale.router.metrics import RouterMetrics, is_spill
from kvscale.router.prefill_ledger import ttft_inputs
from kvscale.router.replicas import Replica
from kvscale.router.ttft_calibration import NONE, TtftCalibration

log = logging.getLogger("kvscale.router.decision")

SESSIONS_KEPT = 100_000
# A block routed to a replica twice within this long is hot there: a new prefix should not evict
# it. The floor; on a slow fleet the window stretches with the prefill wait (HOT_LATENCY_FACTOR).
HOT_WINDOW_S = 30.0
# A slow fleet reuses a prefix less often per second, not less: the window spans this many prefill
# waits (docs/router.md, "Room for new prefixes").
HOT_LATENCY_FACTOR = 4.0
# At most this many block hashes remembered per replica (a busy router's 30 s can hold millions).
HOT_BLOCKS_KEPT = 262_144


class SessionMemory:
    """The replica each session's last request went to, least recently used forgotten first."""

    def __init__(self, capacity: int = SESSIONS_KEPT) -> None:
        self.capacity = capacity
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def get(self, session: str | None) -> str | None:
        return self._replicas.get(session) if session else None

    def remember(self, session: str | None, replica_id: str) -> None:
        if not session:
            return
        self._replicas[session] = replica_id
        self._replicas.move_to_end(session)
        while len(self._replicas) > self.capacity:
            self._replicas.popitem(last=False)


def group_key(hashes: Sequence[int]) -> str | None:
    """What a prompt's group is remembered by (``GroupHomes``): the chained hash of its first
    ``P // 2`` blocks, ``P`` the largest power of two up to its block count.

    Prompts of a group share a long prefix and differ in a short tail, so the key falls inside
    what they share whenever their own tails take under half the prompt. Keyed by the leading
    block, a system prompt every group opens with (a block or longer) would make every group one,
    each new group sent to the last one's home. Halving a power of two keeps the key where a
    group's prompts differ in length by a few blocks; it may take the shared opening for the group
    only where that opening is over a quarter of the prompt."""
    if not hashes:
        return None
    return str(hashes[max(1, (1 << (len(hashes).bit_length() - 1)) // 2) - 1])


class GroupHomes(SessionMemory):
    """The replica each group (``group_key``) was last sent to, how many of the remembered groups
    call each replica home: its share of the groups, where no replica has room for a new one
    (kvscale.router.cold_placement.shared_home), and when a group last made it its home
    (``last_homed``)."""

    def __init__(self, capacity: int = SESSIONS_KEPT) -> None:
        super().__init__(capacity)
        self._homed: dict[str, int] = {}
        self._moves = 0
        self._last_homed: dict[str, int] = {}

    def remember(self, session: str | None, replica_id: str) -> None:
        if not session:
            return
        previous = self._replicas.get(session)
        if previous is not None:
            self._homed[previous] -= 1
        if previous != replica_id:
            self._moves += 1
            self._last_homed[replica_id] = self._moves
        self._homed[replica_id] = self._homed.get(replica_id, 0) + 1
        self._replicas[session] = replica_id
        self._replicas.move_to_end(session)
        while len(self._replicas) > self.capacity:
            _, gone = self._replicas.popitem(last=False)
            self._homed[gone] -= 1

    def homed(self, replica_id: str) -> int:
        return self._homed.get(replica_id, 0)

    def last_homed(self, replica_id: str) -> int:
        """The order in which a group last made the replica its home, counted over all replicas
        (0: none has)."""
        return self._last_homed.get(replica_id, 0)


class HotBlocks:
    """Per replica, the prompt blocks this router sent there at least twice within ``HOT_WINDOW_S``:
    the KV room its hot prefixes take, so that a cold prompt goes where it evicts none of them.
    (A block sent once is a unique suffix, or a prefix not yet reused: LRU may take it.)"""

    def __init__(self, window_s: float = HOT_WINDOW_S, capacity: int = HOT_BLOCKS_KEPT) -> None:
        self.window_floor_s = window_s
        self.window_s = window_s
        self.capacity = capacity
        # replica -> block hash -> (last sent, times sent), oldest first
        self._sent: dict[str, OrderedDict[int, tuple[float, int]]] = {}
        self._hot: dict[str, int] = {}  # replica -> how many of its entries were sent twice or more

    def stretch(self, latency_s: float) -> None:
        """The slowest prefill in sight (as ``PrefixIndex.stretch``): the window spans
        HOT_LATENCY_FACTOR of them, at least its floor."""
        self.window_s = max(self.window_floor_s, HOT_LATENCY_FACTOR * max(latency_s, 0.0))

    def sent(self, replica_id: str, hashes: list[int], now: float) -> None:
        blocks = self._sent.setdefault(replica_id, OrderedDict())
        self._expire(replica_id, now)
        for block_hash in hashes:
            _, times = blocks.get(block_hash, (0.0, 0))
            if times == 1:
                self._hot[replica_id] = self._hot.get(replica_id, 0) + 1
            blocks[block_hash] = (now, times + 1)
            blocks.move_to_end(block_hash)
        while len(blocks) > self.capacity:
            _, (_, times) = blocks.popitem(last=False)
            if times >= 2:
                self._hot[replica_id] -= 1

    def _expire(self, replica_id: str, now: float) -> None:
        blocks = self._sent.get(replica_id)
        cutoff = now - self.window_s
        while blocks and next(iter(blocks.values()))[0] < cutoff:
            _, (_, times) = blocks.popitem(last=False)
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

    def forget(self, replica_id: str) -> None:
        self._sent.pop(replica_id, None)
        self._hot.pop(replica_id, None)


def free_blocks(kv_blocks_total: int, hot_blocks: int) -> int | None:
    """KV room a cold prompt may take without evicting a hot prefix; None when the size is unknown."""
    return max(kv_blocks_total - hot_blocks, 0) if kv_blocks_total > 0 else None


def candidate_view(
    replica: Replica,
    matched_blocks: int,
    heartbeats: HeartbeatTable,
    in_flight: InFlight,
    now: float,
    hot_blocks: int = 0,
    host_blocks: int = 0,
    ttft_scale: float = 1.0,
    recent_blocks: int = 0,
    confirmed: Container[int] = frozenset(),
    fleet_decode_s: float = 0.0,
    adapter: str | None = None,
    homed_groups: int = 0,
    last_homed: int = 0,
) -> routing.Candidate:
    """One replica as the policy sees it; ``now`` is this router's monotonic clock, onto which
    the heartbeat's time is brought before any comparison (the replica's clock may be off);
    ``confirmed``: the blocks the replica reported holding (its waiting prefill counts a prefix
    shared by requests queued there once); ``fleet_decode_s``: the typical decode over the fleet
    (a replica where none of ours has finished yet borrows it for its slot wait); ``adapter``: the
    request's LoRA adapter (None: the base model), how ready the replica is for it;
    ``homed_groups``: the groups (``group_key``) this router last sent there, ``last_homed``: when
    a group last made it its home (``GroupHomes``)."""
    hb = heartbeats.get(replica.replica_id)
    room: int | None = None
    kv_blocks = 0
    hb_time = 0.0
    if hb is None:
        load, kv_usage = replica.in_flight, 0.0
    else:
        hb_time = heartbeats.local_time(hb)
        load = routing.effective_load(replica.in_flight, hb.load, hb_time, replica.last_finished)
        kv_usage = hb.kv_usage
        room = free_blocks(hb.kv_blocks_total, hot_blocks)
        kv_blocks = hb.kv_blocks_total
    extra = ttft_inputs(hb, in_flight.ledger(replica.replica_id), now, hb_time, confirmed, fleet_decode_s)
    return routing.Candidate(replica.replica_id, load, kv_usage, matched_blocks, host_blocks=host_blocks,
                             free_blocks=room, kv_blocks=kv_blocks, ttft_scale=ttft_scale, recent_blocks=recent_blocks,
                             lora_affinity=replica_affinity(adapter, hb), homed_groups=homed_groups,
                             last_homed=last_homed, **extra)


def note_overload(since: dict[str, float], seen: dict[str, float], judged: tuple[str, bool] | None,
                  now: float) -> None:
    """Keep the spill rule's verdicts for the hysteresis: when each replica's overload began and
    (``seen``) when it was last judged overloaded; a verdict of not overloaded ends it."""
    if judged is None:
        return
    replica_id, overloaded = judged
    if overloaded:
        since.setdefault(replica_id, now)
        seen[replica_id] = now
    else:
        since.pop(replica_id, None)
        seen.pop(replica_id, None)


def forget_stale_overloads(since: dict[str, float], seen: dict[str, float], now: float, gap_s: float) -> None:
    """An overload nobody has judged for ``gap_s`` is over: the hysteresis asks for an overload
    that lasted without a break, and a verdict of long ago (the replica's prefixes not asked for
    since) is no evidence of one now. Kept, it passed the replica over at its next verdict, at once
    (docs/router.md, "Hysteresis")."""
    for replica_id in [r for r, last in seen.items() if now - last > gap_s]:
        since.pop(replica_id, None)
        del seen[replica_id]


def decision_record(views: list[routing.Candidate], decision: routing.Decision, now: float,
                    hash_key: int | str = "") -> dict:
    """One decision as the debug log records it (docs/router.md, "Decision records"): what each
    replica looked like, where the request went and why, and a spill's estimates."""
    return {
        "t": round(now, 3), "key": str(hash_key), "chosen": decision.ranked[0] if decision.ranked else None, "reason": decision.reason,
        "replicas": {c.replica_id: {"matched": c.matched_blocks, "load": c.load, "queued": c.queued_prefill_tokens,
                                    "decoding": c.num_decoding, "rate": round(c.prefill_tokens_per_s, 1),
                                    "free": c.free_blocks, "ahead": c.sequences_ahead,
                                    "slots": c.batch_slots, "homed": c.homed_groups} for c in views},
        "spill": None if decision.spill is None else {
            k: round(v, 3) if isinstance(v, float) else v for k, v in decision.spill.__dict__.items()},
    }


class Decider:
    def __init__(
        self,
        config: RouterConfig,
        index: PrefixIndex,
        heartbeats: HeartbeatTable,
        in_flight: InFlight,
        metrics: RouterMetrics,
    ) -> None:
        self.config = config
        self.index = index
        self.heartbeats = heartbeats
        self.in_flight = in_flight
        self.metrics = metrics
        self.sessions = SessionMemory()
        # The replica each group was last sent to (a prompt nobody holds returns there
        # when no replica has room for it: kvscale.router.cold_placement.returning_home).
        self.homes = GroupHomes()
        self.hot = HotBlocks()
        # The spill rule's verdicts (on holders and on returning groups' homes), for the hysteresis:
        self.overloaded_since: dict[str, float] = {}  # replica -> since when the rule held
        self.overload_seen: dict[str, float] = {}  # replica -> when the rule last held
        # predicted-ttft's estimate against the TTFTs the forwarder measures, per replica.
        self.calibration = TtftCalibration()
        self._counter = 0  # requests decided, for round-robin
        self._rng = random.Random(config.seed)

    def forget(self, replica_id: str) -> None:
        """A replica left the fleet (discovery dropped it): everything kept per replica goes, in the
        index, the ledgers, the heartbeat table, the hot blocks and the metrics' series."""
        self.index.forget(replica_id)
        self.in_flight.forget(replica_id)
        self.heartbeats.forget(replica_id)
        self.hot.forget(replica_id)
        self.overloaded_since.pop(replica_id, None)
        self.overload_seen.pop(replica_id, None)
        self.calibration.forget(replica_id)
        self.metrics.forget_replica(replica_id)

    def renamed(self, old: str, new: str) -> None:
        """A replica routed to under its address was named by its first heartbeat: its open
        requests' ledger moves to the name, what else was kept under the address goes (else a fleet
        whose pods come and go keeps a dead series per pod)."""
        self.in_flight.rename(old, new)
        self.index.forget(old)
        self.heartbeats.forget(old)
        self.hot.forget(old)
        self.calibration.forget(old)
        self.metrics.forget_replica(old)

    def decide(
        self,
        candidates: list[Replica],
        hashes: list[int],
        hash_key: int | str,
        session: str | None,
        prompt_tokens: int = 0,
        block_size: int = 16,
        adapter: str | None = None,
    ) -> routing.Decision:
        """Rank ``candidates`` for a prompt of ``hashes`` (its full blocks) and ``prompt_tokens``
        under the LoRA adapter ``adapter`` (None: the base model).

        ``hash_key`` is any stable key of the prompt (its leading block hash when it has one):
        ties and a stale index go by rendezvous hashing on it.
        """
        by_id = {r.replica_id: r for r in candidates}
        now = time.monotonic()
        # Predictions live until the slowest prefill in sight is done (docs/router.md, "Predictions"),
        # and a prefix stays hot as long on a slow fleet as on a fast one.
        wait = max((ledger.prefill_wait(now) for rid in by_id
                    if (ledger := self.in_flight.ledger(rid)) is not None), default=0.0)
        self.index.stretch(wait)
        self.hot.stretch(wait)
        # An overload must outlast one prefill wait before a holder is passed over (hysteresis).
        forget_stale_overloads(self.overloaded_since, self.overload_seen, now, self.hot.window_s)
        hold = routing.OverloadHold(now, wait, self.overloaded_since)
        matched = (
            self.index.match(hashes, by_id, now)
            if routing.uses_prefix(self.config.policy) else dict.fromkeys(by_id, 0)
        )
        in_host = self.index.match_host(hashes, matched)
        ttft_policy = self.config.policy == "predicted-ttft"
        calibration = self.calibration.current(list(by_id)) if ttft_policy else NONE
        # Decisions read the correction only when told to; the estimate reported is corrected anyway.
        applied = calibration if self.config.ttft_calibration else NONE
        # How long a sequence holds a batch slot, for a replica where none of ours has ended yet.
        decodes = [t for rid in by_id if (ledger := self.in_flight.ledger(rid)) is not None
                   and (t := ledger.typical_decode_s()) > 0]
        fleet_decode_s = statistics.median(decodes) if decodes else 0.0
        views = [
            candidate_view(r, matched[r.replica_id], self.heartbeats, self.in_flight, now,
                           self.hot.footprint(r.replica_id, now), in_host.get(r.replica_id, 0),
                           applied.scale(r.replica_id), self.hot.recent(r.replica_id, now),
                           self.index.confirmed_view(r.replica_id), fleet_decode_s, adapter,
                           self.homes.homed(r.replica_id), self.homes.last_homed(r.replica_id))
            for r in candidates
        ]
        index_stale = self.heartbeats.index_stale
        if index_stale:
            self.metrics.fallbacks.labels("redis_down").inc()
        self._counter += 1
        decision = routing.decide(
            self.config.policy,
            views,
            prompt_blocks=len(hashes),
            hash_key=hash_key,
            counter=self._counter,
            rng=self._rng,
            epsilon=self.config.epsilon,
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            ttft_epsilon=self.config.ttft_epsilon,
            ttft_overhead_s=applied.overhead_s,
            sticky_replica=self.sessions.get(session),
            index_stale=index_stale,
            hold=hold,
            last_home=self.homes.get(group_key(hashes)),
        )
        note_overload(self.overloaded_since, self.overload_seen, decision.judged, now)
        if decision.ranked and is_spill(matched, decision.ranked[0], decision.reason):
            self.metrics.spills.inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision %s", json.dumps(decision_record(views, decision, now, hash_key)))
        if decision.ranked:
            self.hot.sent(decision.ranked[0], hashes, now)
            self.homes.remember(group_key(hashes), decision.ranked[0])
        if decision.ranked and decision.uncalibrated_ttft_s is not None:
            decision = replace(decision, predicted_ttft_s=calibration.overhead_s
                               + calibration.scale(decision.ranked[0]) * decision.uncalibrated_ttft_s)
        return decision
