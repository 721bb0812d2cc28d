"""``bench.w3_policy_sim --mode epsilon-grid``: the earlier hit-rate study of the bounded-load
rule, prefix-affinity against round-robin by epsilon and pool size, on W3's stream, an LRU of
whole prefixes and invented service times."""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections import OrderedDict

from bench.common import write_result
from kvscale.router import policy as routing


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
