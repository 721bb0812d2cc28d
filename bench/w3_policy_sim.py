"""Routing policies, simulated: a calibrated model of the real run, then policies compared in seconds.

Two modes.

``--mode calibrated`` (default). Each replica is a continuous-batching engine: FCFS, a token budget
per step, prompt blocks findable when scheduled, an LRU KV pool of the real size in blocks, answer
blocks cached as they are decoded. A step costs ``decode_step_s`` if anything decodes (plus
``decode_step_per_seq_s`` per sequence beyond the first, where a calibration measured it) plus its
prompt tokens over ``prefill_tokens_per_s``: the two figures are taken from a real run's own
heartbeats (``bench.w3_router`` samples them; ``--calibration`` names its JSON). The simulated
router is the real one's decision functions (``kvscale.router.policy``) fed what the real router
sees (prefix matches from the index incl. its 10 s predictions, in-flight requests, queued prefill
tokens, decodes, KV usage), except that it sees queues exactly where the real router reads
heartbeats up to a second old and corrects them with its own sends. The request streams are
``bench.w3_workloads``' (same seeds as the real run; W4 prompts are built with the real chat
template, answers are filler of the measured length). First the real run's setup is replayed and
its TTFT p50/p90 per (workload, policy) compared with the measured ones (the agreement), then a grid
of pool sizes, concurrency levels and workloads compares the policies.

``--mode hit-bound``: how high a hit rate W3 allows at all, against round-robin's. Two bounds: the
arithmetic ceiling (a request can reuse only blocks some earlier request computed, so every
group's first request misses whatever the policy) and ``oracle``, a simulator-only policy that
sends every request to the replica truly holding (cached, or queued to compute) the longest
prefix of it, ignoring load, cold prompts by consistent hashing. Every policy runs beside them
on the real run's setup and on the issue's full W3, plus a pool-size sweep at full size, and for
each of the issue's targets the policy closest to it is named.

``--mode ceiling``: each policy's hit rate as a fraction of the workload's ceiling, the best hit rate
any assignment of requests to replicas could reach with the same KV capacities: Belady's optimal
eviction (MIN) over one pool of the fleet's combined size, on the arrival-ordered requests (a fleet
of separate pools can only do worse: a copy of a block on a second replica takes room, never adds
a hit), counted as the engine counts hits (leading blocks, never a prompt's last token). For W3,
W3-Zipf and W4 at the real run's setup, the issue's full W3, a workload whose hot prefixes fit in
the fleet (12 groups x 512-token prefix, 144 requests, 8 in flight, 3 replicas x 160 blocks) and the
same stream on pools too small to hold them (3 x 96 blocks).

``--mode epsilon-grid``: the earlier hit-rate study of the bounded-load rule (prefix-affinity
against round-robin by epsilon and pool size; W3's stream, an LRU of whole prefixes, invented
service times).

    python -m bench.w3_policy_sim --calibration bench/results/w3_router_ttft.json
    python -m bench.w3_policy_sim --mode hit-bound     # bench/results/w3_policy_sim_hit_bound.json
    python -m bench.w3_policy_sim --mode ceiling       # bench/results/w3_policy_sim_ceiling.json
    python -m bench.w3_policy_sim --mode epsilon-grid --out bench/results/w3_policy_sim.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import machine, quantile, write_result
from kvscale.router import policy as routing
from kvscale.router.decision import HotBlocks, free_blocks
from kvscale.router.ttft_calibration import NONE as NO_CALIBRATION
from kvscale.router.ttft_calibration import TtftCalibration


def simulate(
    policy: str, capacity: float, epsilon: float, *, groups: int, requests: int, concurrency: int,
    replicas: int, seed: int,
) -> float:
    """Fraction of requests routed to a replica holding their prefix."""
    rng = random.Random(seed)
    order = [i % groups for i in range(requests)]
    rng.shuffle(order)
    cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]
    running: list[dict[int, int]] = [{} for _ in range(replicas)]  # group -> requests in flight
    in_flight = [0] * replicas
    completions: list[tuple[float, int, int]] = []
    hits = dispatched = 0

    def holds(replica: int, group: int) -> bool:
        return group in cached[replica] or running[replica].get(group, 0) > 0

    def touch(replica: int, group: int) -> None:
        cache = cached[replica]
        cache[group] = None
        cache.move_to_end(group)
        while len(cache) > capacity:
            victim = next((g for g in cache if not running[replica].get(g)), None)
            if victim is None:
                break
            del cache[victim]

    def dispatch(now: float) -> None:
        nonlocal hits, dispatched
        group = order[dispatched]
        dispatched += 1
        candidates = [
            routing.Candidate(f"r{i}", in_flight[i], 0.0, 1 if holds(i, group) else 0) for i in range(replicas)
        ]
        decision = routing.decide(policy, candidates, prompt_blocks=1, hash_key=f"group-{group}",
                                  counter=dispatched, rng=rng, epsilon=epsilon)
        replica = int(decision.ranked[0][1:])
        hit = holds(replica, group)
        hits += hit
        in_flight[replica] += 1
        running[replica][group] = running[replica].get(group, 0) + 1
        touch(replica, group)
        heapq.heappush(completions, (now + (20 if hit else 25) * rng.uniform(0.7, 1.3), replica, group))

    for _ in range(min(concurrency, requests)):
        dispatch(0.0)
    while completions:
        now, replica, group = heapq.heappop(completions)
        in_flight[replica] -= 1
        running[replica][group] -= 1
        touch(replica, group)
        if dispatched < requests:
            dispatch(now)
    return hits / requests


def epsilon_grid(args) -> int:

    shape = dict(groups=args.groups, requests=args.requests, concurrency=args.concurrency, replicas=args.replicas)
    rows = []
    for capacity in (float(c) for c in args.capacities.split(",")):
        round_robin = statistics.median(
            simulate("round-robin", capacity, 0.0, seed=s, **shape) for s in range(args.seeds)
        )
        for epsilon in (float(e) for e in args.epsilons.split(",")):
            affinity = statistics.median(
                simulate("prefix-affinity", capacity, epsilon, seed=s, **shape) for s in range(args.seeds)
            )
            rows.append({"capacity_prefixes": capacity, "epsilon": epsilon, "affinity_hit_fraction": affinity,
                         "round_robin_hit_fraction": round_robin, "ratio": affinity / round_robin})
            print(f"pool {capacity:>4} prefixes  eps {epsilon:<4}  affinity {affinity:.2f}  "
                  f"round-robin {round_robin:.2f}  ratio {affinity / round_robin:.2f}", flush=True)
    path = write_result("w3_policy_sim", {
        "benchmark": "w3_policy_sim", "date": time.strftime("%Y-%m-%d"), "parameters": vars(args), "results": rows,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0


# -- the calibrated simulator ------------------------------------------------------------------------

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


@dataclass
class Workload:
    """Closed-loop clients: each client runs its list of requests in order, pausing think_s before each."""

    clients: list[list[tuple[float, list[int], list[int], int]]]  # (think_s, prompt ids, answer ids, out tokens)


def simulate_run(workload: Workload, policy: str, *, replicas: int, num_blocks: int, block_size: int,
                 costs: Costs | list[Costs], seed: int = 0, details: bool = False,
                 reported: list[Costs] | None = None) -> dict:
    """``costs``: one for every replica, or a list (a pool of unequal replicas); ``reported``: what
    each replica's heartbeat says of its speed, when not its true ``costs``."""
    from kvscale.block_hash import hash_prompt_blocks

    per_replica = costs if isinstance(costs, list) else [costs] * replicas
    pool = [SimReplica(i, num_blocks, block_size, per_replica[i], reported[i] if reported else None)
            for i in range(replicas)]
    router = SimRouter(policy, pool, block_size, seed)
    for rep in pool:
        rep.on_stored = router.stored
    events: list[tuple[float, int, str, int]] = []  # (time, tiebreak, kind, client or replica)
    tie = 0
    position = [0] * len(workload.clients)
    requests: list[SimRequest] = []

    def push(t: float, kind: str, who: int) -> None:
        nonlocal tie
        tie += 1
        heapq.heappush(events, (t, tie, kind, who))

    def kick(rep: SimReplica, now: float) -> None:
        if not rep.stepping and (rep.waiting or rep.running):
            rep.stepping = True
            push(now, "step", rep.index)

    for c, reqs in enumerate(workload.clients):
        if reqs:
            push(reqs[0][0], "arrive", c)
    owner: dict[int, int] = {}
    while events:
        now, _, kind, who = heapq.heappop(events)
        if kind == "first":
            router.first_token(requests[who])
            continue
        if kind == "arrive":
            think, prompt, answer, out = workload.clients[who][position[who]]
            req = SimRequest(len(requests), now, hash_prompt_blocks(prompt, block_size), len(prompt), out,
                             hash_prompt_blocks(prompt + answer, block_size))
            requests.append(req)
            owner[req.rid] = who
            req.replica = router.route(req, now)
            rep = pool[req.replica]
            rep.waiting.append(req)
            kick(rep, now)
        else:
            rep = pool[who]
            if not (rep.waiting or rep.running):
                rep.stepping = False
                continue
            end, firsts, done = rep.step(now)
            push(end, "step", who)
            for req in firsts:
                push(end, "first", req.rid)  # the router sees it when it happens, not when computed
            for req in done:
                c = owner[req.rid]
                position[c] += 1
                if position[c] < len(workload.clients[c]):
                    push(end + workload.clients[c][position[c]][0], "arrive", c)
    ttfts = [r.first_token - r.arrival for r in requests]
    prompt_tokens = sum(r.prompt_tokens for r in requests)
    counts = [sum(1 for r in requests if r.replica == i) for i in range(replicas)]
    wall = max(r.finished for r in requests) - min(r.arrival for r in requests)
    return {
        "policy": policy,
        "requests": len(requests),
        "hit_rate": sum(r.hit_tokens for r in requests) / prompt_tokens,
        "ttft_p50_s": quantile(ttfts, 0.5),
        "ttft_p90_s": quantile(ttfts, 0.9),
        "output_tokens_per_s": sum(r.output_tokens for r in requests) / wall,
        "max_over_mean_requests": max(counts) / statistics.mean(counts),
        **({"requests_detail": requests} if details else {}),
    }


def build_workload(kind: str, p: dict, seed: int, tokenizer=None, answer_tokens: int | None = None) -> Workload:
    """A bench.w3_workloads stream as simulated clients (``p``: the real run's parameters)."""
    from bench import w3_workloads as wl

    if kind in ("w3", "w3-zipf"):
        prompts = [q for _, q in wl.shared_prefix_prompts(seed, p["groups"], p["prefix_tokens"], p["requests"],
                                                         p["suffix_tokens"], zipf=kind == "w3-zipf")]
        clients: list[list] = [[] for _ in range(p["concurrency"])]
        # A closed loop of C clients taking the next prompt when free behaves like C fixed clients
        # taking every C-th prompt when service times are alike; good enough for a queueing model.
        for i, prompt in enumerate(prompts):
            clients[i % p["concurrency"]].append((0.0, prompt, [], p["output_tokens"]))
        return Workload(clients)
    from kvscale.tokenization import chat_prompt_token_ids

    n_answer = answer_tokens or p["answer_tokens"]
    rng = random.Random(seed + 7)
    convs = wl.conversations(seed, p["conversations"], p["document_words"], p["question_words"],
                             (p["think_min_s"], p["think_max_s"]))
    clients = [[] for _ in range(p["concurrency"])]
    for i, conv in enumerate(convs):
        answers: list[str] = []
        turns = []
        for turn in range(len(conv.questions)):
            prompt = chat_prompt_token_ids(tokenizer, wl.conversation_messages(conv, turn, answers))
            answer_text = " ".join(rng.choice(wl.WORDS) for _ in range(n_answer))
            answer_ids = tokenizer.encode(answer_text, add_special_tokens=False)[:n_answer]
            turns.append((conv.think_s[turn], prompt, answer_ids, n_answer))
            answers.append(tokenizer.decode(answer_ids))
        clients[i % p["concurrency"]].extend(turns)
    return Workload(clients)


METRICS = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "max_over_mean_requests")


def over_seeds(kind: str, p: dict, policy: str, seeds: int, tokenizer, answer_tokens: int, cache: dict, **sim) -> dict:
    """Medians over ``seeds`` different request streams of the same shape (seed, seed + 1, ...)."""
    runs = []
    for s in range(seeds):
        key = (kind, s, json.dumps(p, sort_keys=True, default=str))
        if key not in cache:
            cache[key] = build_workload(kind, p, p["seed"] + s, tokenizer, answer_tokens)
        runs.append(simulate_run(cache[key], policy, seed=s, **sim))
    return {k: statistics.median(run[k] for run in runs) for k in METRICS}


def calibration(real: dict) -> tuple[dict, Costs, int, dict]:
    """From a real run's JSON: its parameters, the cost model, W4's answer length, W4's parameters."""
    params = real["parameters"]
    # One cost model for the whole run: medians over every run's heartbeat medians.
    rates = [r["replica_rates"] for r in real["results"]]
    costs = Costs(
        prefill_tokens_per_s=statistics.median(x["prefill_tokens_per_s_median"] for x in rates if x["prefill_tokens_per_s_median"]),
        decode_step_s=statistics.median(x["decode_step_s_median"] for x in rates if x["decode_step_s_median"]),
        step_tokens=params.get("max_num_batched_tokens") or 2048,
        max_num_seqs=params["concurrency"],
    )
    # W4 answers: the measured mean answer length.
    w4 = [q for r in real["results"] if r["workload"] == "w4" for q in r["per_request"]]
    answer_tokens = round(statistics.mean(q["output_tokens"] for q in w4)) if w4 else params["answer_tokens"]
    # The real run drove W4 in slices of conversations (``--blocks``): that many at a time.
    blocks = params.get("blocks", 1)
    w4_params = dict(params, concurrency=min(params["concurrency"], -(-params["conversations"] // blocks)))
    return params, costs, answer_tokens, w4_params


def calibrated(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    shape = dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                 block_size=params["block_size"], costs=costs)
    agreement = []
    workloads: dict[str, Workload] = {}
    for r in real["results"]:
        kind = r["workload"]
        if kind not in workloads:
            workloads[kind] = build_workload(kind, w4_params if kind == "w4" else params, params["seed"], tokenizer,
                                             answer_tokens)
        # Each real run is replayed with the rates its own replicas measured while it ran.
        own = r["replica_rates"]
        run_costs = Costs(own["prefill_tokens_per_s_median"] or costs.prefill_tokens_per_s,
                          own["decode_step_s_median"] or costs.decode_step_s, costs.step_tokens, costs.max_num_seqs)
        sim = simulate_run(workloads[kind], r["policy"], seed=params["seed"], **dict(shape, costs=run_costs))
        row = {"workload": kind, "policy": r["policy"], "costs": run_costs.__dict__,
               "real": {k: r[k] for k in ("ttft_p50_s", "ttft_p90_s", "prefix_cache_hit_rate", "output_tokens_per_s")},
               "sim": {k: sim[k] for k in ("ttft_p50_s", "ttft_p90_s", "hit_rate", "output_tokens_per_s")}}
        row["p50_ratio_sim_over_real"] = sim["ttft_p50_s"] / r["ttft_p50_s"]
        row["p90_ratio_sim_over_real"] = sim["ttft_p90_s"] / r["ttft_p90_s"]
        agreement.append(row)
        print(f"agree {kind:8} {r['policy']:16} TTFT p50 real {r['ttft_p50_s']:.2f} sim {sim['ttft_p50_s']:.2f}  "
              f"p90 real {r['ttft_p90_s']:.2f} sim {sim['ttft_p90_s']:.2f}  hit real "
              f"{r['prefix_cache_hit_rate']:.2f} sim {sim['hit_rate']:.2f}", flush=True)

    # The grid: policies in seconds across pool sizes, concurrency and workloads, same costs.
    grid = []
    streams: dict = {}
    policies = args.policies.split(",")
    for replicas in (int(x) for x in args.pools.split(",")):
        for per_replica in (int(x) for x in args.concurrency_per_replica.split(",")):
            p = dict(params, concurrency=replicas * per_replica, groups=params["groups"] * replicas // params["replicas"],
                     requests=args.grid_requests_per_replica * replicas,
                     conversations=args.grid_conversations_per_replica * replicas)
            cost = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, max(per_replica * 2, 4))
            for kind in args.grid_workloads.split(","):
                for policy in policies:
                    row = {"replicas": replicas, "concurrency": replicas * per_replica, "workload": kind,
                           "policy": policy}
                    row.update(over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams,
                                          replicas=replicas, num_blocks=params["num_gpu_blocks_override"],
                                          block_size=params["block_size"], costs=cost))
                    grid.append(row)
                    print(f"grid n={replicas:<3} C={replicas * per_replica:<3} {kind:8} {policy:16} hit {row['hit_rate']:.2f} "
                          f"p50 {row['ttft_p50_s']:.2f} p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f} "
                          f"max/mean {row['max_over_mean_requests']:.2f}", flush=True)
    # Unequal replicas (e.g. two GPU generations in one pool): speeds x1.5, x1, x1, x0.5 of the calibrated
    # costs. Only predicted-ttft reads each replica's measured rates.
    hetero = []
    speeds = [float(x) for x in args.hetero_speeds.split(",")]
    pool_costs = [Costs(costs.prefill_tokens_per_s * f, costs.decode_step_s / f, costs.step_tokens, costs.max_num_seqs)
                  for f in speeds]
    for kind in args.grid_workloads.split(","):
        for policy in policies:
            row = {"speeds": speeds, "workload": kind, "policy": policy}
            row.update(over_seeds(kind, w4_params if kind == "w4" else params, policy, args.seeds, tokenizer,
                                  answer_tokens, streams, **dict(shape, replicas=len(speeds), costs=pool_costs)))
            hetero.append(row)
            print(f"hetero {kind:8} {policy:16} hit {row['hit_rate']:.2f} p50 {row['ttft_p50_s']:.2f} "
                  f"p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f}", flush=True)

    # What bounds the W3 targets at the real run's size: every group's first request is a cold miss
    # under any policy, so vary how many requests share the groups (same pool, same costs).
    sweep = []
    for requests in (int(x) for x in args.sweep_requests.split(",")):
        p = dict(params, requests=requests)
        row: dict = {"requests": requests, "cold_miss_share": params["groups"] / requests}
        for policy in ("predicted-ttft", "round-robin"):
            row[policy] = over_seeds("w3", p, policy, args.seeds, tokenizer, answer_tokens, streams, **shape)
        ours, rr = row["predicted-ttft"], row["round-robin"]
        row["hit_rate_ratio"] = ours["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        row["ttft_p50_better"] = rr["ttft_p50_s"] / ours["ttft_p50_s"]
        row["ttft_p90_better"] = rr["ttft_p90_s"] / ours["ttft_p90_s"]
        row["throughput_ratio"] = ours["output_tokens_per_s"] / rr["output_tokens_per_s"]
        sweep.append(row)
        print(f"sweep W3 R={requests:<4} cold {row['cold_miss_share']:.2f}  hit x{row['hit_rate_ratio']:.2f}  "
              f"p50 x{row['ttft_p50_better']:.2f}  p90 x{row['ttft_p90_better']:.2f}  "
              f"tput x{row['throughput_ratio']:.2f}", flush=True)
    # The issue's full W3 (16 groups of 512 tokens, 256 requests, 32 output tokens, 16 in flight,
    # 192-block pools) at the calibrated costs: the size this machine cannot run in ten minutes.
    full = []
    full_params = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                       concurrency=16)
    for kind in ("w3", "w3-zipf"):
        for policy in policies:
            row = {"workload": kind, "policy": policy}
            row.update(over_seeds(kind, full_params, policy, args.seeds, tokenizer, answer_tokens, streams,
                                  replicas=4, num_blocks=192, block_size=params["block_size"],
                                  costs=Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)))
            full.append(row)
            print(f"full {kind:8} {policy:16} hit {row['hit_rate']:.2f} p50 {row['ttft_p50_s']:.2f} "
                  f"p90 {row['ttft_p90_s']:.2f} tok/s {row['output_tokens_per_s']:.1f} "
                  f"max/mean {row['max_over_mean_requests']:.2f}", flush=True)
    path = write_result("w3_policy_sim_calibrated", {
        "benchmark": "w3_policy_sim", "mode": "calibrated", "date": time.strftime("%Y-%m-%d"),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "agreement": agreement, "grid": grid, "w3_requests_sweep": sweep,
        "heterogeneous_pool": hetero, "full_w3": full,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0


def hit_ceiling(workload: Workload, block_size: int) -> float:
    """The best hit rate any routing allows: one replica with an unbounded cache. A request can
    reuse only the blocks requests before it computed (prompts and answers), at most all but its
    last token (the engine computes that one), so every group's first request misses."""
    from kvscale.block_hash import hash_prompt_blocks

    seen: set[int] = set()
    hit = total = 0
    for client in workload.clients:  # each client's requests in order; clients share prefixes alike
        for _, prompt, answer, _ in client:
            hashes = hash_prompt_blocks(prompt, block_size)
            n = 0
            for h in hashes[: (len(prompt) - 1) // block_size]:
                if h not in seen:
                    break
                n += 1
            hit += n * block_size
            total += len(prompt)
            seen.update(hashes)
            seen.update(hash_prompt_blocks(prompt + answer, block_size))
    return hit / total


def arrival_order(workload: Workload) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) in about the order a closed loop sends them: every client's n-th request
    before any client's (n+1)-th (for W3 exactly the generated stream's order)."""
    out = []
    longest = max((len(c) for c in workload.clients), default=0)
    for n in range(longest):
        for client in workload.clients:
            if n < len(client):
                _, prompt, answer, _ = client[n]
                out.append((prompt, answer))
    return out


def capacity_ceiling(workload: Workload, block_size: int, total_blocks: int) -> float:
    """The best hit rate any routing could reach with ``total_blocks`` of KV in all: Belady's MIN
    (evict the block needed furthest in the future; among equals the one furthest into its prompt,
    so prefixes stay whole) over one pool of the fleet's size. Hits as the engine counts them."""
    from kvscale.block_hash import hash_prompt_blocks

    requests = arrival_order(workload)
    looked: list[list[int]] = []  # blocks each request may hit, in order
    stored: list[list[int]] = []  # blocks it leaves computed (prompt, then prompt + answer)
    for prompt, answer in requests:
        hashes = hash_prompt_blocks(prompt, block_size)
        looked.append(hashes[: (len(prompt) - 1) // block_size])
        stored.append(list(dict.fromkeys(hashes + hash_prompt_blocks(prompt + answer, block_size))))
    uses: dict[int, deque[int]] = {}
    for j, blocks in enumerate(looked):
        for h in blocks:
            uses.setdefault(h, deque()).append(j)
    never = len(requests)
    cache: dict[int, int] = {}  # block -> its position in the prompt that stored it
    hit = total = 0
    for j, (prompt, _) in enumerate(requests):
        n = 0
        for h in looked[j]:
            if h not in cache:
                break
            n += 1
        hit += n * block_size
        total += len(prompt)
        for h in looked[j]:
            queue = uses[h]
            while queue and queue[0] <= j:
                queue.popleft()
        for position, h in enumerate(stored[j]):
            cache[h] = position
        while len(cache) > total_blocks:
            victim = max(cache, key=lambda b: (uses[b][0] if uses.get(b) else never, cache[b]))
            del cache[victim]
    return hit / total if total else 0.0


def ceiling_cases(params: dict, w4_params: dict, costs: Costs) -> list[tuple[str, str, dict, dict]]:
    """(case, workload kind, stream parameters, fleet) for --mode ceiling."""
    real = dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                block_size=params["block_size"], costs=costs)
    full = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                concurrency=16)
    issue = dict(params, groups=12, prefix_tokens=512, suffix_tokens=16, requests=144, output_tokens=4,
                 concurrency=8)
    eight = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 8)
    sixteen = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)
    half = Costs(costs.prefill_tokens_per_s / 2, costs.decode_step_s * 2, costs.step_tokens, 8)
    return [
        ("W3, real-run setup", "w3", params, real),
        ("W3-Zipf, real-run setup", "w3-zipf", params, real),
        ("W4, real-run setup", "w4", w4_params, real),
        ("full W3 (16 x 512, 4 x 192 blocks)", "w3", full,
         dict(replicas=4, num_blocks=192, block_size=params["block_size"], costs=sixteen)),
        ("fits (12 x 512, 3 x 160 blocks)", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=eight)),
        ("does not fit (12 x 512, 3 x 96 blocks)", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=eight)),
        ("does not fit, Zipf (12 x 512, 3 x 96 blocks)", "w3-zipf", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=eight)),
        # One replica at half the others' speed, as its heartbeat says (replicas time their own
        # steps); then one whose heartbeat reports the others' speed (a neighbour arrived since:
        # what the TTFT calibration is for, since the raw estimate cannot see it).
        ("fits, one replica at half speed", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=[half, eight, eight])),
        ("does not fit, one replica at half speed", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=[half, eight, eight])),
        ("fits, one replica at half its reported speed", "w3", issue,
         dict(replicas=3, num_blocks=160, block_size=params["block_size"], costs=[half, eight, eight],
              reported=[eight] * 3)),
        ("does not fit, one replica at half its reported speed", "w3", issue,
         dict(replicas=3, num_blocks=96, block_size=params["block_size"], costs=[half, eight, eight],
              reported=[eight] * 3)),
    ]


ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_info() -> dict:
    """The CPU's model and its vector ISA flags, from /proc/cpuinfo (empty where there is none)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "isa_flags": [f for f in ISA_FLAGS if f in flags], **machine()}


def ceiling_mode(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    policies = args.policies.split(",")
    streams: dict = {}
    cases = []
    for case, kind, p, fleet in ceiling_cases(params, w4_params, costs):
        ceilings = []
        for s in range(args.seeds):
            key = (kind, s, json.dumps(p, sort_keys=True, default=str))
            if key not in streams:
                streams[key] = build_workload(kind, p, p["seed"] + s, tokenizer, answer_tokens)
            ceilings.append(capacity_ceiling(streams[key], fleet["block_size"], fleet["replicas"] * fleet["num_blocks"]))
        ceiling = statistics.median(ceilings)
        rows = {}
        for policy in policies:
            row = over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams, **fleet)
            row["share_of_ceiling"] = row["hit_rate"] / ceiling if ceiling else float("nan")
            rows[policy] = row
        rr = rows.get("round-robin")
        if rr is not None:
            for row in rows.values():
                row["ttft_p90_over_round_robin"] = row["ttft_p90_s"] / rr["ttft_p90_s"]
        cases.append({"case": case, "workload": kind, "fleet": {k: v for k, v in fleet.items() if k not in ("costs", "reported")},
                      "ceiling": ceiling, "policies": rows})
        print(f"{case:46} ceiling {ceiling:.3f}", flush=True)
        for policy, row in rows.items():
            print(f"    {policy:16} hit {row['hit_rate']:.3f} ({row['share_of_ceiling']:.2f} of ceiling)  "
                  f"p50 {row['ttft_p50_s']:.2f}  p90 {row['ttft_p90_s']:.2f}  max/mean "
                  f"{row['max_over_mean_requests']:.2f}", flush=True)
    path = write_result("w3_policy_sim_ceiling", {
        "benchmark": "w3_policy_sim", "mode": "ceiling", "date": time.strftime("%Y-%m-%d"), "machine": cpu_info(),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "cases": cases,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0


# The issue's targets against round-robin, same run: (metric, "higher" or "lower" is better, target).
TARGETS = {
    "hit_rate_ratio": ("higher", 3.0),
    "ttft_p50_better": ("higher", 3.0),
    "ttft_p90_better": ("higher", 1.5),
    "throughput_ratio": ("higher", 1.3),
    "max_over_mean_requests": ("lower", 1.3),
}


def against_round_robin(row: dict, rr: dict) -> dict:
    return {
        "hit_rate_ratio": row["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf"),
        "ttft_p50_better": rr["ttft_p50_s"] / row["ttft_p50_s"],
        "ttft_p90_better": rr["ttft_p90_s"] / row["ttft_p90_s"],
        "throughput_ratio": row["output_tokens_per_s"] / rr["output_tokens_per_s"],
        "max_over_mean_requests": row["max_over_mean_requests"],
    }


def hit_bound(args) -> int:
    from kvscale.model_files import load_tokenizer, resolve_tokenizer_path

    real = json.loads(Path(args.calibration).read_text())
    params, costs, answer_tokens, w4_params = calibration(real)
    tokenizer = load_tokenizer(resolve_tokenizer_path(None))
    policies = [ORACLE, *args.policies.split(",")]
    full_params = dict(params, groups=16, prefix_tokens=512, suffix_tokens=16, requests=256, output_tokens=32,
                       concurrency=16)
    full_costs = Costs(costs.prefill_tokens_per_s, costs.decode_step_s, costs.step_tokens, 16)
    setups = [
        ("real-run setup", params, dict(replicas=params["replicas"], num_blocks=params["num_gpu_blocks_override"],
                                        block_size=params["block_size"], costs=costs), ("w3", "w3-zipf", "w4")),
        ("issue's full W3", full_params, dict(replicas=4, num_blocks=192, block_size=params["block_size"],
                                              costs=full_costs), ("w3", "w3-zipf")),
    ]
    streams: dict = {}

    def ceiling(kind: str, p: dict) -> float:
        values = []
        for s in range(args.seeds):
            key = (kind, s, json.dumps(p, sort_keys=True, default=str))
            if key not in streams:
                streams[key] = build_workload(kind, p, p["seed"] + s, tokenizer, answer_tokens)
            values.append(hit_ceiling(streams[key], params["block_size"]))
        return statistics.median(values)

    cases = []
    for setup, base, shape, kinds in setups:
        for kind in kinds:
            p = w4_params if kind == "w4" else base
            rows = {policy: over_seeds(kind, p, policy, args.seeds, tokenizer, answer_tokens, streams, **shape)
                    for policy in policies}
            rr = rows["round-robin"]
            case: dict = {"setup": setup, "workload": kind, "hit_ceiling": ceiling(kind, p),
                          "round_robin_hit_rate": rr["hit_rate"]}
            case["hit_ratio_ceiling"] = case["hit_ceiling"] / rr["hit_rate"]
            case["policies"] = {policy: {**row, **against_round_robin(row, rr)} for policy, row in rows.items()}
            real_policies = [q for q in policies if q not in (ORACLE, "round-robin")]
            closest = {}
            for target, (better, goal) in TARGETS.items():
                values = {q: case["policies"][q][target] for q in real_policies}
                best = (max if better == "higher" else min)(values, key=values.__getitem__)
                met = values[best] >= goal if better == "higher" else values[best] <= goal
                closest[target] = {"policy": best, "value": values[best], "target": goal, "met": met}
            for metric in ("ttft_p50_s", "ttft_p90_s"):
                values = {q: case["policies"][q][metric] for q in real_policies}
                closest[f"best_{metric}"] = {"policy": min(values, key=values.__getitem__), "value": min(values.values())}
            case["closest"] = closest
            cases.append(case)
            ours, oracle = case["policies"]["predicted-ttft"], case["policies"][ORACLE]
            print(f"{setup:16} {kind:8} ceiling {case['hit_ceiling']:.3f} (x{case['hit_ratio_ceiling']:.2f} rr)  "
                  f"oracle {oracle['hit_rate']:.3f} (x{oracle['hit_rate_ratio']:.2f}) p50 {oracle['ttft_p50_s']:.2f} "
                  f"p90 {oracle['ttft_p90_s']:.2f}  predicted-ttft {ours['hit_rate']:.3f} "
                  f"(x{ours['hit_rate_ratio']:.2f})  rr {rr['hit_rate']:.3f}", flush=True)
            for target, c in closest.items():
                print(f"    {target:24} {c['policy']:16} {c['value']:.3f}"
                      + (f"  target {c['target']}  {'met' if c['met'] else 'missed'}" if "target" in c else ""))
    # The ratio's bound is the ceiling over round-robin's rate, and round-robin's rate grows with the pool.
    pools = []
    for num_blocks in (int(x) for x in args.bound_pools.split(",")):
        shape = dict(replicas=4, num_blocks=num_blocks, block_size=params["block_size"], costs=full_costs)
        row = {"num_blocks": num_blocks, "prefixes_per_pool": num_blocks * params["block_size"] / 528,
               "hit_ceiling": ceiling("w3", full_params)}
        for policy in (ORACLE, "predicted-ttft", "round-robin"):
            row[policy] = over_seeds("w3", full_params, policy, args.seeds, tokenizer, answer_tokens, streams,
                                     **shape)["hit_rate"]
        row["hit_ratio_ceiling"] = row["hit_ceiling"] / row["round-robin"]
        pools.append(row)
        print(f"pool {num_blocks:>4} blocks ({row['prefixes_per_pool']:.1f} prefixes)  ceiling x{row['hit_ratio_ceiling']:.2f}  "
              f"oracle {row[ORACLE]:.3f}  predicted-ttft {row['predicted-ttft']:.3f}  rr {row['round-robin']:.3f}",
              flush=True)
    path = write_result("w3_policy_sim_hit_bound", {
        "benchmark": "w3_policy_sim", "mode": "hit-bound", "date": time.strftime("%Y-%m-%d"),
        "calibration": {"from": args.calibration, "costs": costs.__dict__, "w4_answer_tokens": answer_tokens},
        "parameters": vars(args), "targets": TARGETS, "cases": cases, "full_w3_pool_sweep": pools,
    }, args.out)
    print(f"w3_policy_sim: wrote {path}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("calibrated", "hit-bound", "ceiling", "epsilon-grid"),
                        default="calibrated")
    parser.add_argument("--calibration", default="bench/results/w3_router_ttft.json",
                        help="a bench.w3_router JSON: its setup is replayed and its heartbeat rates are the costs")
    parser.add_argument("--policies", default="predicted-ttft,prefix-affinity,weighted,round-robin,least-load")
    parser.add_argument("--pools", default="4,8,16")
    parser.add_argument("--concurrency-per-replica", default="2,4")
    parser.add_argument("--grid-workloads", default="w3,w3-zipf,w4")
    parser.add_argument("--grid-requests-per-replica", type=int, default=24)
    parser.add_argument("--grid-conversations-per-replica", type=int, default=4)
    parser.add_argument("--hetero-speeds", default="1.5,1,1,0.5", help="relative replica speeds of the unequal pool")
    parser.add_argument("--sweep-requests", default="64,128,256,512",
                        help="W3 at the real run's setup with this many requests (fewer cold misses)")
    parser.add_argument("--bound-pools", default="96,144,192,288,384",
                        help="hit-bound: KV blocks per replica swept at the issue's full W3")
    # epsilon-grid mode
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--epsilons", default="0.25,0.5,1.0")
    parser.add_argument("--capacities", default="4.5,5.8,7,8.7",
                        help="prefixes per replica's pool (W3's 192 blocks of 16 hold 5.8 of 528 tokens)")
    parser.add_argument("--seeds", type=int, default=5, help="request streams (workload seeds) per point")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mode == "calibrated":
        return calibrated(args)
    if args.mode == "hit-bound":
        return hit_bound(args)
    if args.mode == "ceiling":
        return ceiling_mode(args)
    return epsilon_grid(args)


if __name__ == "__main__":
    raise SystemExit(main())
