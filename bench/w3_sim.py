"""The calibrated fleet simulator's model (bench.w3_policy_sim, ``--mode calibrated``): each
replica a continuous-batching engine (FCFS, a token budget per step, an LRU KV pool of whole
blocks, answer blocks cached as they decode) whose steps cost what a real run's heartbeats
measured (`Costs`), and a router that decides with the real router's functions
(``kvscale.router.policy``) on what the real router sees. With ``heartbeat_queue`` (the routing
grid's runs) a replica reports and evicts as the engine does: its heartbeat is the stats taken
after its last step and its KV events arrive as a step ends (``SimReplica.publish``), and it frees
a request's blocks tail first, so its LRU keeps a prefix's leading blocks longest."""

from __future__ import annotations

import math
import random
import statistics
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.w3_cache_aware import CacheAware
from kvscale.router import policy as routing
from kvscale.router.decision import HotBlocks, free_blocks, note_overload
from kvscale.router.index import prediction_ttl
from kvscale.router.prefill_ledger import (
    RECENT_WAITS,
    Sent,
    decode_left,
    queued_prefill_tokens,
    waiting_prefill,
)
from kvscale.router.ttft_calibration import NONE as NO_CALIBRATION
from kvscale.router.ttft_calibration import TtftCalibration


@dataclass
class Costs:
    prefill_tokens_per_s: float
    decode_step_s: float
    step_tokens: int = 2048  # the engine's max_num_batched_tokens
    max_num_seqs: int = 8
    # What each decoding sequence beyond the first adds to a step (0: a step costs the same at any
    # batch, the model the router runs were calibrated with).
    decode_step_per_seq_s: float = 0.0

    def decode_s(self, num_decoding: int) -> float:
        if num_decoding == 0:
            return 0.0
        return self.decode_step_s + self.decode_step_per_seq_s * (num_decoding - 1)


@dataclass
class HeartbeatView:
    """What a replica's heartbeat says at ``time``: the engine's stats as taken after its last step
    (server/engine/core_loop.py ``step_and_publish``; server/engine/engine_stats.py), so a prefill
    being computed counts in full until the step that computes it ends. ``time`` is just before
    the step's end: a request sent at that instant arrived after the stats were taken."""

    time: float = -math.inf
    prefill_tokens_waiting: int = 0
    num_waiting: int = 0
    num_decoding: int = 0


@dataclass
class SimRequest:
    rid: int
    arrival: float
    hashes: list[int]  # prompt block hashes (the engine's own function)
    prompt_tokens: int
    output_tokens: int
    answer_hashes: list[int] = field(default_factory=list)  # blocks of prompt + answer (cached as decoded)
    replica: int = -1
    to_prefill: int = 0
    generated: int = 0
    first_token: float | None = None
    finished: float | None = None
    hit_tokens: int = 0
    expected_hit_blocks: int = 0  # what the router's index matched on the chosen replica
    predicted_ttft_s: float | None = None  # predicted-ttft's raw estimate for the chosen replica
    pinned: list[int] = field(default_factory=list)
    # The decision record (bench.w3_spill_log): why affinity was lost, what the placement evicted.
    record: dict = field(default_factory=dict)
    evicted: list[int] = field(default_factory=list)  # block hashes its admission pushed out


class SimReplica:
    def __init__(self, index: int, num_blocks: int, block_size: int, costs: Costs,
                 reported: Costs | None = None) -> None:
        self.index = index
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.costs = costs
        # What its heartbeat says of its speed (a replica slowed by a neighbour reports stale rates).
        self.reported = reported or costs
        self.cache: OrderedDict[int, None] = OrderedDict()  # block hash -> (LRU order)
        # What its KV events have told the router: a block is reported stored once computed (its
        # prompt's prefill done, as the engine registers full blocks), removed when evicted.
        self.announced: set[int] = set()
        # The router reads this replica as the real router reads a real one (``heartbeat_queue``):
        # its heartbeat as of its last step's end (``heartbeat``), its KV events as that step
        # ends (``publish``), as the engine hands both to its publisher after every step. Else the
        # router's own ledger, and the replica's state as each step starts.
        self.heartbeat_queue = False
        self.heartbeat = HeartbeatView()
        self._events: list[tuple[bool, list[int]]] = []  # (stored, hashes) since the step began
        self.step_end: float | None = None  # the running step's end, until it is published
        self.refs: dict[int, int] = {}  # pinned by running requests
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy_until = 0.0
        self.stepping = False
        # Told the hashes this replica stores (its KV events): the router's index confirms them.
        self.on_stored: Callable[[int, list[int]], None] = lambda index, hashes: None

    # what the router sees
    def queued_prefill_tokens(self) -> int:
        # As this router's ledger counts its own sends: the prompt less what the index matched there;
        # or (``heartbeat_queue``) as the replica's heartbeat counts a waiting prompt: less only what
        # is cached now, so a prefix still being computed counts in full for every sibling behind it.
        waiting = sum(r.prompt_tokens - max(self._cached_prefix(r),
                                            0 if self.heartbeat_queue else r.expected_hit_blocks) * self.block_size
                      for r in self.waiting)
        return waiting + sum(r.to_prefill for r in self.running)

    def true_match(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` this replica holds or will have computed before a request
        sent now is scheduled (FCFS: what its queued and running requests compute)."""
        held = set(self.cache)
        for r in (*self.waiting, *self.running):
            held.update(r.hashes)
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def heartbeat_waiting(self) -> int:
        return len(self.waiting)

    def unstarted_sends(self, now: float) -> list[Sent]:
        """The router's ledger of this replica, as far as the correction reads it: its requests here
        whose first token it has not seen by ``now``, in the order sent, with their blocks."""
        pending = sorted((r for r in (*self.running, *self.waiting) if r.first_token is None or r.first_token > now),
                         key=lambda r: r.rid)
        return [Sent(max(r.prompt_tokens - r.expected_hit_blocks * self.block_size, 1), r.arrival,
                     hashes=r.hashes, prompt_tokens=r.prompt_tokens) for r in pending]

    def num_decoding(self) -> int:
        return sum(1 for r in self.running if r.to_prefill == 0)

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def kv_usage(self) -> float:
        return min(1.0, len(self.refs) / self.num_blocks)

    def _cached_prefix(self, req: SimRequest) -> int:
        n = 0
        for h in req.hashes[: (req.prompt_tokens - 1) // self.block_size]:
            if h not in self.cache:
                break
            n += 1
        return n

    def _pin(self, req: SimRequest, hashes: list[int]) -> bool:
        new = [h for h in hashes if h not in self.refs]
        if len(self.refs) + len(new) > self.num_blocks:
            return False
        for h in hashes:
            self.refs[h] = self.refs.get(h, 0) + 1
            self.cache[h] = None
            self.cache.move_to_end(h)
            req.pinned.append(h)
        while len(self.cache) > self.num_blocks:
            victim = next((h for h in self.cache if h not in self.refs), None)
            if victim is None:
                break
            del self.cache[victim]
            self._report(False, [victim])
            req.evicted.append(victim)
        return True

    def _unpin(self, req: SimRequest) -> None:
        # A replica read as a real one (``heartbeat_queue``) frees a request's blocks tail first, as
        # the engine does (server/core/kv_cache_manager.py ``free``; server/core/block_pool.py): a
        # block joins the LRU's end when its last user lets it go, so a prefix loses its last blocks
        # first and keeps its leading ones. (Else the LRU is by admission, a prefix's leading block
        # first: evicting it loses the whole prefix, as hashes are chained.)
        for h in (reversed(req.pinned) if self.heartbeat_queue else req.pinned):
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
                if self.heartbeat_queue:
                    self.cache.move_to_end(h)
        req.pinned = []

    def step(self, now: float, slowdown: float = 1.0) -> tuple[float, list[SimRequest], list[SimRequest]]:
        """Run one engine step from ``now``: (its end, requests that got their first token, finished).
        ``slowdown`` stretches the step (replicas sharing a host's cores: bench.autoscale_sim)."""
        budget = self.costs.step_tokens
        decoding = [r for r in self.running if r.to_prefill == 0]
        budget -= len(decoding)
        prefill_tokens = 0
        prefilling: list[SimRequest] = []
        for r in self.running:
            if r.to_prefill > 0 and budget > 0:
                take = min(r.to_prefill, budget)
                prefilling.append(r)
                r._take = take  # type: ignore[attr-defined]
                budget -= take
                prefill_tokens += take
        while self.waiting and budget > 0 and len(self.running) < self.costs.max_num_seqs:
            r = self.waiting[0]
            hit = self._cached_prefix(r)
            if not self._pin(r, r.hashes):
                break
            self.waiting.popleft()
            r.hit_tokens = hit * self.block_size
            r.to_prefill = max(r.prompt_tokens - r.hit_tokens, 1)
            self.running.append(r)
            take = min(r.to_prefill, budget)
            prefilling.append(r)
            r._take = take  # type: ignore[attr-defined]
            budget -= take
            prefill_tokens += take
        seconds = slowdown * (self.costs.decode_s(len(decoding))
                              + prefill_tokens / self.costs.prefill_tokens_per_s)
        end = now + max(seconds, 1e-4)
        firsts, done = [], []
        for r in prefilling:
            r.to_prefill -= r._take  # type: ignore[attr-defined]
            if r.to_prefill == 0:
                r.first_token = end
                r.generated = 1
                firsts.append(r)
                self._report(True, [h for h in r.hashes if h in self.cache])
        for r in decoding:
            r.generated += 1
        for r in list(self.running):
            if r.to_prefill == 0 and r.generated >= r.output_tokens:
                self.running.remove(r)
                self._unpin(r)
                # Answer blocks were registered as decoded: they stay cached (LRU).
                self._pin(r, r.answer_hashes)
                self._unpin(r)
                r.finished = end
                done.append(r)
        self.step_end = end
        return end, firsts, done

    def _report(self, stored: bool, hashes: list[int]) -> None:
        """A KV event: at once, or (``heartbeat_queue``) when the step ends (``publish``)."""
        if self.heartbeat_queue:
            self._events.append((stored, hashes))
        else:
            self._apply(stored, hashes)

    def _apply(self, stored: bool, hashes: list[int]) -> None:
        if stored:
            self.announced.update(hashes)
            self.on_stored(self.index, hashes)
        else:
            self.announced.difference_update(hashes)

    def publish(self, now: float) -> None:
        """The step that ends at ``now`` is done: its KV events reach the router, and the heartbeat
        is the engine's stats taken now (``HeartbeatView``). Called once per step, at its end."""
        events, self._events = self._events, []
        for stored, hashes in events:
            self._apply(stored, hashes)
        self.step_end = None
        self.heartbeat = HeartbeatView(math.nextafter(now, -math.inf), self.queued_prefill_tokens(),
                                       self.heartbeat_waiting(), self.num_decoding())


class SimRouter:
    """The real decision functions over the simulated replicas, with the router's predictions
    (their lifetime stretched as the real index's is: ``kvscale.router.index.prediction_ttl`` of the
    slowest prefill in sight) (``predicted-ttft/cal``: deciding on the calibrated estimate, the
    router's --ttft-calibration)."""

    def __init__(self, policy: str, replicas: list[SimReplica], block_size: int, seed: int) -> None:
        name = policy.partition("@")[0]
        self.calibration = TtftCalibration() if name.endswith(CAL) else None
        # "/ttl10": the router before its windows followed the fleet's latency, for A/B: predictions
        # live a fixed 10 s, the hot window a fixed 30 s, and no hysteresis.
        self.fixed_ttl = FIXED_TTL in policy
        # "/rawqueue": the router before it took a shared prefix's repeats off the heartbeat's
        # queue (kvscale.router.prefill_ledger.shared_prefix_tokens), for A/B in the same run.
        self.raw_queue = RAW_QUEUE in policy
        # "/noslot": the router before its estimate counted the wait for a batch slot
        # (kvscale.router.predicted_ttft.slot_wait_s), for A/B in the same run.
        self.no_slot = NO_SLOT in policy
        self.policy = policy.replace(CAL, "").replace(FIXED_TTL, "").replace(RAW_QUEUE, "").replace(NO_SLOT, "")
        self.replicas = replicas
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.counter = 0
        # By replica index (a fleet that scales adds replicas with new indices): hash -> when predicted.
        self.predicted: defaultdict[int, dict[int, float]] = defaultdict(dict)
        self.prediction_ttl_s = PREDICTION_FLOOR_S
        self.waits: deque[float] = deque(maxlen=RECENT_WAITS)  # recent sends' waits for a first token
        self.hot = HotBlocks()  # as the real Decider keeps it: the room a cold prompt may take
        self.cache_aware = CacheAware(block_size)
        self.overloaded_since: dict[str, float] = {}  # the Decider's hysteresis state
        self.homes: dict[int, str] = {}  # leading block -> replica last sent to (the Decider's homes)
        # The router's ledger of its sends, by replica index, as far as the slot wait reads it.
        self.sent: defaultdict[int, list[SimRequest]] = defaultdict(list)
        self.decodes: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=RECENT_WAITS))

    def stored(self, replica: int, hashes: list[int]) -> None:
        """The replica reported these blocks stored: as in the real index, a confirmed block is no
        longer a prediction, so once the replica evicts it the index no longer says it is there."""
        predicted = self.predicted[replica]
        for h in hashes:
            predicted.pop(h, None)

    def first_token(self, req: SimRequest) -> None:
        """The router saw ``req``'s first token: a (predicted, measured) pair for its calibration."""
        if req.first_token is not None:
            self.waits.append(req.first_token - req.arrival)
        if self.calibration is not None and req.predicted_ttft_s and req.first_token is not None:
            self.calibration.observe(f"r{req.replica}", req.predicted_ttft_s, req.first_token - req.arrival)

    def matched(self, replica: SimReplica, hashes: list[int], now: float) -> int:
        predicted = self.predicted[replica.index]
        n = 0
        for h in hashes:
            if h not in replica.announced and now - predicted.get(h, -math.inf) > self.prediction_ttl_s:
                break
            n += 1
        return n

    def route(self, req: SimRequest, now: float) -> int:
        name, _, eps = self.policy.partition("@")
        if name == ORACLE:
            return self.route_oracle(req)
        if name == CACHE_AWARE:
            return self.route_cache_aware(req)
        # A replica read as a real one (``heartbeat_queue``): a first token is the router's once it
        # streams, at its step's end (the simulator sets its time as the step starts).
        unstarted = [now - r.arrival for rep in self.replicas for r in (*rep.waiting, *rep.running)
                     if r.first_token is None or (rep.heartbeat_queue and r.first_token > now)]
        wait = max([*unstarted, *self.waits], default=0.0)
        self.prediction_ttl_s = PREDICTION_FLOOR_S if self.fixed_ttl else prediction_ttl(PREDICTION_FLOOR_S, wait)
        if not self.fixed_ttl:
            self.hot.stretch(wait)
        cands = []
        ids = [f"r{rep.index}" for rep in self.replicas]
        calibration = self.calibration.current(ids) if self.calibration is not None else NO_CALIBRATION
        slots = {rep.index: self.slot_inputs(rep, now) for rep in self.replicas}
        typical = [statistics.median(d) for d in self.decodes.values() if d]
        fleet_decode_s = statistics.median(typical) if typical else 0.0
        for rep in self.replicas:
            mine, decodes = slots[rep.index]
            cands.append(routing.Candidate(
                f"r{rep.index}", rep.load(), rep.kv_usage(),
                self.matched(rep, req.hashes, now) if routing.uses_prefix(name) else 0,
                queued_prefill_tokens=self.queued(rep, now),
                num_decoding=rep.heartbeat.num_decoding if rep.heartbeat_queue else rep.num_decoding(),
                prefill_tokens_per_s=rep.reported.prefill_tokens_per_s, decode_step_s=rep.reported.decode_step_s,
                step_token_budget=rep.costs.step_tokens,
                free_blocks=free_blocks(rep.num_blocks, self.hot.footprint(f"r{rep.index}", now)), kv_blocks=rep.num_blocks,
                recent_blocks=self.hot.recent(f"r{rep.index}", now),
                ttft_scale=calibration.scale(f"r{rep.index}"),
                batch_slots=0 if self.no_slot else rep.costs.max_num_seqs, sequences_ahead=rep.load(),
                decode_left_s=decode_left(mine, statistics.median(decodes) if decodes else fleet_decode_s, now),
            ))
        self.counter += 1
        decision = routing.decide(
            name, cands, prompt_blocks=len(req.hashes), hash_key=req.hashes[0] if req.hashes else req.rid,
            counter=self.counter, rng=self.rng, epsilon=float(eps) if eps else 0.25,
            prompt_tokens=req.prompt_tokens, block_size=self.block_size,
            ttft_overhead_s=calibration.overhead_s,
            hold=None if self.fixed_ttl else routing.OverloadHold(now, wait, self.overloaded_since),
            last_home=self.homes.get(req.hashes[0]) if req.hashes else None,
        )
        note_overload(self.overloaded_since, decision.judged, now)
        chosen = int(decision.ranked[0][1:])
        req.expected_hit_blocks = decision.matched_blocks
        req.record = self.record(req, cands, decision)
        req.predicted_ttft_s = decision.uncalibrated_ttft_s
        self.hot.sent(decision.ranked[0], req.hashes, now)
        self.homes.update({req.hashes[0]: decision.ranked[0]} if req.hashes else {})
        self.sent[chosen].append(req)
        if routing.uses_prefix(name):
            announced = next(rep.announced for rep in self.replicas if rep.index == chosen)
            for h in req.hashes:
                if h not in announced:  # the real index predicts only what it has not confirmed
                    self.predicted[chosen][h] = now
        return chosen


    def slot_inputs(self, rep: SimReplica, now: float) -> tuple[list[Sent], deque[float]]:
        """The router's open sends to ``rep`` as its ledger holds them at ``now`` (first byte seen
        or not), and its recent decodes there (first byte to end), the ended sends moved to them."""
        open_now, kept = [], []
        decodes = self.decodes[rep.index]
        for r in self.sent[rep.index]:
            if r.finished is not None and r.finished <= now:
                if r.first_token is not None:
                    decodes.append(r.finished - r.first_token)
                continue
            kept.append(r)
            started = r.first_token if r.first_token is not None and r.first_token <= now else None
            open_now.append(Sent(r.prompt_tokens, r.arrival, started_at=started))
        self.sent[rep.index] = kept
        return open_now, decodes

    def queued(self, rep: SimReplica, now: float) -> int:
        """The replica's waiting prefill as the router reads it: its last heartbeat (``heartbeat_queue``:
        taken at its last step's end) corrected by the router's own sends as the real router corrects it
        (``kvscale.router.prefill_ledger.waiting_prefill``; ``/rawqueue``: without the shared prefix's
        repeats taken off), or the router's own ledger alone."""
        if not rep.heartbeat_queue:
            return rep.queued_prefill_tokens()
        hb = rep.heartbeat
        if self.raw_queue:
            return queued_prefill_tokens(hb.prefill_tokens_waiting, hb.time, rep.unstarted_sends(now))
        return waiting_prefill(hb.prefill_tokens_waiting, hb.num_waiting, hb.time, rep.unstarted_sends(now),
                               self.block_size, rep.announced)

    def record(self, req: SimRequest, cands: list[routing.Candidate], decision: routing.Decision) -> dict:
        """What this decision knew against what was true: the index's best match, the replicas'
        true holdings (cached or queued to compute), and the spill's estimates."""
        true = {f"r{rep.index}": rep.true_match(req.hashes) for rep in self.replicas}
        seen = max((c.matched_blocks for c in cands), default=0)
        out: dict = {"chosen": decision.ranked[0], "reason": decision.reason, "index_best": seen,
                     "true_best": max(true.values(), default=0), "true_chosen": true[decision.ranked[0]]}
        if decision.spill is not None:
            out["spill"] = decision.spill.__dict__
        return out

    def route_cache_aware(self, req: SimRequest) -> int:
        """`vllm-router`'s cache_aware on its own history and in-flight counts (bench.w3_cache_aware)."""
        chosen, matched = self.cache_aware.choose(req.hashes, req.prompt_tokens,
                                                  {rep.index: rep.load() for rep in self.replicas})
        req.expected_hit_blocks = matched
        return chosen

    def route_oracle(self, req: SimRequest) -> int:
        """The longest prefix actually held, load ignored; a cold prompt by consistent hashing of its
        leading block, so a group's later requests find its first one."""
        matches = [rep.true_match(req.hashes) for rep in self.replicas]
        best = max(matches)
        holders = [f"r{i}" for i, m in enumerate(matches) if m == best]
        chosen = int(routing.consistent_hash_order(req.hashes[0] if req.hashes else req.rid, holders)[0][1:])
        req.expected_hit_blocks = best
        return chosen


PREDICTION_FLOOR_S = 10.0  # the real router's (kvscale.router.app builds its index with it)
CACHE_AWARE = "vllm-router-cache-aware"  # the baseline's model (bench.w3_cache_aware)
ORACLE = "oracle"  # simulator only: it reads the replicas' true caches and queues


FIXED_TTL = "/ttl10"
RAW_QUEUE = "/rawqueue"
NO_SLOT = "/noslot"
CAL = "/cal"  # predicted-ttft/cal: decides on the calibrated estimate (the router's --ttft-calibration)
