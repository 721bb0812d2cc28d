"""The simulated router (bench.w3_sim's fleet): the real router's decision functions
(``kvscale.router.policy``) fed what the real router sees of the simulated replicas (prefix
matches from its index and predictions, in-flight requests, heartbeats corrected by its own
sends), the cache_aware baseline's model (bench.w3_cache_aware) and the simulator-only oracle."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict, deque

from bench.w3_cache_aware import CacheAware
from bench.w3_sim import SimReplica, SimRequest
from kvscale.router import policy as routing
from kvscale.router.decision import (
    GroupHomes,
    HotBlocks,
    forget_stale_overloads,
    free_blocks,
    group_key,
    note_overload,
)
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
        self.overload_seen: dict[str, float] = {}
        self.homes = GroupHomes()  # group key -> replica last sent to (the Decider's homes)
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
                homed_groups=self.homes.homed(f"r{rep.index}"), last_homed=self.homes.last_homed(f"r{rep.index}"),
                ttft_scale=calibration.scale(f"r{rep.index}"),
                batch_slots=0 if self.no_slot else rep.costs.max_num_seqs, sequences_ahead=rep.load(),
                decode_left_s=decode_left(mine, statistics.median(decodes) if decodes else fleet_decode_s, now),
            ))
        self.counter += 1
        forget_stale_overloads(self.overloaded_since, self.overload_seen, now, self.hot.window_s)
        decision = routing.decide(
            name, cands, prompt_blocks=len(req.hashes), hash_key=req.hashes[0] if req.hashes else req.rid,
            counter=self.counter, rng=self.rng, epsilon=float(eps) if eps else 0.25,
            prompt_tokens=req.prompt_tokens, block_size=self.block_size,
            ttft_overhead_s=calibration.overhead_s,
            hold=None if self.fixed_ttl else routing.OverloadHold(now, wait, self.overloaded_since),
            last_home=self.homes.get(group_key(req.hashes)),
        )
        note_overload(self.overloaded_since, self.overload_seen, decision.judged, now)
        chosen = int(decision.ranked[0][1:])
        req.expected_hit_blocks = decision.matched_blocks
        req.record = self.record(req, cands, decision)
        req.predicted_ttft_s = decision.uncalibrated_ttft_s
        self.hot.sent(decision.ranked[0], req.hashes, now)
        self.homes.remember(group_key(req.hashes), decision.ranked[0])
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
