"""One simulated run of the fleet (`bench.w3_sim`) on a workload's closed-loop clients, its
figures (hit rate, TTFT p50/p90, output tokens/s, balance), their medians over several request
streams, and the cost model taken from a real run's JSON (bench.w3_router)."""

from __future__ import annotations

import heapq
import json
import statistics

from bench.stats import quantile
from bench.w3_sim import Costs, SimReplica, SimRequest
from bench.w3_sim_router import SimRouter
from bench.w3_workloads import Workload, build_workload


def simulate_run(workload: Workload, policy: str, *, replicas: int, num_blocks: int, block_size: int,
                 costs: Costs | list[Costs], seed: int = 0, details: bool = False,
                 reported: list[Costs] | None = None, heartbeat_queue: bool = False) -> dict:
    """``costs``: one for every replica, or a list (a pool of unequal replicas); ``reported``: what
    each replica's heartbeat says of its speed, when not its true ``costs``; ``heartbeat_queue``: the
    replicas report and evict as real ones (bench.w3_sim), the router reads their heartbeats."""
    from kvscale.block_hash import hash_prompt_blocks

    per_replica = costs if isinstance(costs, list) else [costs] * replicas
    pool = [SimReplica(i, num_blocks, block_size, per_replica[i], reported[i] if reported else None)
            for i in range(replicas)]
    router = SimRouter(policy, pool, block_size, seed)
    for rep in pool:
        rep.on_stored = router.stored
        rep.heartbeat_queue = heartbeat_queue
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
            if rep.step_end is not None:  # a step ends now (not an idle replica woken by a send)
                rep.publish(now)
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
        "ttft_p99_s": quantile(ttfts, 0.99),
        "ttft_mean_s": statistics.mean(ttfts),
        "output_tokens_per_s": sum(r.output_tokens for r in requests) / wall,
        "max_over_mean_requests": max(counts) / statistics.mean(counts),
        **({"requests_detail": requests} if details else {}),
    }


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
