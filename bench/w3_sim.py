"""The calibrated fleet simulator's model (bench.w3_policy_sim, ``--mode calibrated``): each
replica a continuous-batching engine (FCFS, a token budget per step, an LRU KV pool of whole
blocks, answer blocks cached as they decode) whose steps cost what a real run's heartbeats
measured (`Costs`); the router that decides with the real router's functions on what the real
router sees is bench.w3_sim_router. With ``heartbeat_queue`` (the routing
grid's runs) a replica reports and evicts as the engine does: its heartbeat is the stats taken
after its last step and its KV events arrive as a step ends (``SimReplica.publish``), and it frees
a request's blocks tail first, so its LRU keeps a prefix's leading blocks longest."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscale.router.prefill_ledger import (
    Sent,
)


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
