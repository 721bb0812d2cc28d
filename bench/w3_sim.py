"""The calibrated fleet simulator's model (bench.w3_policy_sim, ``--mode calibrated``): each
replica a continuous-batching engine (FCFS, a token budget per step, an LRU KV pool of whole
blocks, answer blocks cached as they decode) whose steps cost what a real run's heartbeats
measured (`Costs`), and a router that decides with the real router's functions
(``kvscale.router.policy``) on what the real router sees."""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscale.router import policy as routing
from kvscale.router.decision import HotBlocks, free_blocks
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
        self.refs: dict[int, int] = {}  # pinned by running requests
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy_until = 0.0
        self.stepping = False
        # Told the hashes this replica stores (its KV events): the router's index confirms them.
        self.on_stored: Callable[[int, list[int]], None] = lambda index, hashes: None

    # what the router sees
    def queued_prefill_tokens(self) -> int:
        # As this router's ledger counts its own sends: the prompt less what the index matched there.
        waiting = sum(r.prompt_tokens - max(self._cached_prefix(r), r.expected_hit_blocks) * self.block_size
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
        return True

    def _unpin(self, req: SimRequest) -> None:
        for h in req.pinned:
            self.refs[h] -= 1
            if self.refs[h] == 0:
                del self.refs[h]
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
            self.on_stored(self.index, r.hashes)
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
        return end, firsts, done


class SimRouter:
    """The real decision functions over the simulated replicas, with the router's 10 s predictions
    (``predicted-ttft/cal``: deciding on the calibrated estimate, the router's --ttft-calibration)."""

    def __init__(self, policy: str, replicas: list[SimReplica], block_size: int, seed: int) -> None:
        name = policy.partition("@")[0]
        self.calibration = TtftCalibration() if name.endswith(CAL) else None
        self.policy = policy.replace(CAL, "")
        self.replicas = replicas
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.counter = 0
        # By replica index (a fleet that scales adds replicas with new indices): hash -> until when.
        self.predicted: defaultdict[int, dict[int, float]] = defaultdict(dict)
        self.hot = HotBlocks()  # as the real Decider keeps it: the room a cold prompt may take

    def stored(self, replica: int, hashes: list[int]) -> None:
        """The replica reported these blocks stored: as in the real index, a confirmed block is no
        longer a prediction, so once the replica evicts it the index no longer says it is there."""
        predicted = self.predicted[replica]
        for h in hashes:
            predicted.pop(h, None)

    def first_token(self, req: SimRequest) -> None:
        """The router saw ``req``'s first token: a (predicted, measured) pair for its calibration."""
        if self.calibration is not None and req.predicted_ttft_s and req.first_token is not None:
            self.calibration.observe(f"r{req.replica}", req.predicted_ttft_s, req.first_token - req.arrival)

    def matched(self, replica: SimReplica, hashes: list[int], now: float) -> int:
        predicted = self.predicted[replica.index]
        n = 0
        for h in hashes:
            if h not in replica.cache and predicted.get(h, -1.0) < now:
                break
            n += 1
        return n

    def route(self, req: SimRequest, now: float) -> int:
        name, _, eps = self.policy.partition("@")
        if name == ORACLE:
            return self.route_oracle(req)
        cands = []
        ids = [f"r{rep.index}" for rep in self.replicas]
        calibration = self.calibration.current(ids) if self.calibration is not None else NO_CALIBRATION
        for rep in self.replicas:
            cands.append(routing.Candidate(
                f"r{rep.index}", rep.load(), rep.kv_usage(),
                self.matched(rep, req.hashes, now) if routing.uses_prefix(name) else 0,
                queued_prefill_tokens=rep.queued_prefill_tokens(), num_decoding=rep.num_decoding(),
                prefill_tokens_per_s=rep.reported.prefill_tokens_per_s, decode_step_s=rep.reported.decode_step_s,
                step_token_budget=rep.costs.step_tokens,
                free_blocks=free_blocks(rep.num_blocks, self.hot.footprint(f"r{rep.index}", now)),
                ttft_scale=calibration.scale(f"r{rep.index}"),
            ))
        self.counter += 1
        decision = routing.decide(
            name, cands, prompt_blocks=len(req.hashes), hash_key=req.hashes[0] if req.hashes else req.rid,
            counter=self.counter, rng=self.rng, epsilon=float(eps) if eps else 0.25,
            prompt_tokens=req.prompt_tokens, block_size=self.block_size,
            ttft_overhead_s=calibration.overhead_s,
        )
        chosen = int(decision.ranked[0][1:])
        req.expected_hit_blocks = decision.matched_blocks
        req.predicted_ttft_s = decision.uncalibrated_ttft_s
        self.hot.sent(decision.ranked[0], req.hashes, now)
        if routing.uses_prefix(name):
            cache = next(rep.cache for rep in self.replicas if rep.index == chosen)
            for h in req.hashes:
                if h not in cache:  # the real index predicts only what it has not confirmed
                    self.predicted[chosen][h] = now + 10.0
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


ORACLE = "oracle"  # simulator only: it reads the replicas' true caches and queues


CAL = "/cal"  # predicted-ttft/cal: decides on the calibrated estimate (the router's --ttft-calibration)
