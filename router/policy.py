"""Routing decisions as pure functions: candidates and their load in, a ranked list out.

Nothing here does I/O or keeps state between calls (round-robin takes its counter as an
argument), so every rule is unit-tested on plain values.

Predicted TTFT, the default, is its own module (kvscale.router.predicted_ttft): an estimate
of each replica's time to first token and a rule that keeps a prefix where it is.

Weighted scorer (a baseline after llm-d's inference scheduler): a weighted sum of a prefix
score (matched fraction), a queue score (min-max normalised queue depth, fewer is better) and a
KV-cache score (1 - usage), weights 3 / 2 / 2.

Every policy that ranks breaks its ties by a LoRA adapter's readiness on each replica
(``lora_affinity``: resident, a slot free, none free), as llm-d's lora-affinity scorer prefers.

Prefix affinity (``--policy prefix-affinity``):
  score(r) = matched_blocks(r) / prompt_blocks
             - load_weight * load(r) / capacity
             - kv_weight * kv_usage(r)
subject to the bounded-load rule of consistent hashing with bounded loads (Mirrokni et al.):
a replica is eligible only while load(r) + 1 <= ceil((1 + eps) * (total_load + 1) / n), i.e. it
never takes a request that would push it above (1 + eps) times the mean. Ties (and prompts that
match nothing) go to the least loaded replica, then to the highest rendezvous hash of the
prompt's leading block so that several routers agree without talking to each other.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from kvscale.router.candidates import (
    Candidate,
    Decision,
    bounded_capacity,
    bounded_split,
    consistent_hash_order,
    effective_load,
    rendezvous_weight,
    within_bound,
)
from kvscale.router.cold_placement import returning_home
from kvscale.router.predicted_ttft import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    HOST_RESTORE_SPEEDUP,
    RATE_SPREAD,
    TTFT_EPSILON,
    TTFT_SLACK,
    pool_rates,
    predicted_ttft,
    predicted_ttft_policy,
)
from kvscale.router.spill_rule import OverloadHold, evicted_blocks, should_spill

# Callers read every policy's parts through this module (kvscale.router.decision, the benchmarks).
__all__ = [
    "DEFAULT_PREFILL_TOKENS_PER_S", "HOST_RESTORE_SPEEDUP", "RATE_SPREAD", "TTFT_EPSILON", "TTFT_SLACK",
    "Candidate", "Decision", "OverloadHold", "bounded_capacity", "consistent_hash_order", "decide", "effective_load",
    "evicted_blocks",
    "pool_rates", "predicted_ttft", "predicted_ttft_policy", "prefix_affinity", "random_choice",
    "returning_home", "round_robin", "should_spill", "uses_prefix", "weighted", "weighted_scores", "within_bound",
]

POLICIES = ("predicted-ttft", "prefix-affinity", "weighted", "round-robin", "random", "least-load")
DEFAULT_POLICY = "predicted-ttft"
# Policies that look at the prefix index (the router hashes the prompt only for these).
PREFIX_POLICIES = frozenset({"predicted-ttft", "prefix-affinity", "weighted"})
WEIGHTS = {"prefix": 3.0, "queue": 2.0, "kv": 2.0}  # llm-d's default profile favours prefix over queue


def uses_prefix(policy: str) -> bool:
    return policy in PREFIX_POLICIES


def affinity_score(
    candidate: Candidate,
    prompt_blocks: int,
    capacity: int,
    load_weight: float,
    kv_weight: float,
) -> float:
    hit = candidate.matched_blocks / prompt_blocks if prompt_blocks else 0.0
    return hit - load_weight * candidate.load / max(capacity, 1) - kv_weight * candidate.kv_usage


def prefix_affinity(
    candidates: Sequence[Candidate],
    prompt_blocks: int,
    hash_key: int | str,
    *,
    epsilon: float = 0.25,
    load_weight: float = 0.5,
    kv_weight: float = 0.1,
    sticky_replica: str | None = None,
    index_stale: bool = False,
) -> Decision:
    """Rank replicas for one request.

    ``hash_key`` is the prompt's leading block hash (or any stable key when the prompt has no
    full block). ``index_stale`` says Redis is unreachable: the last index is still used, and
    prompts that match nothing go by consistent hashing on the leading block (bounded) instead
    of by load, so that routers without fresh state keep sending a prefix to one place.
    """
    if not candidates:
        return Decision([], 0, "none")
    eligible, over, capacity = bounded_split(candidates, epsilon)
    tie = {c.replica_id: rendezvous_weight(hash_key, c.replica_id) for c in candidates}

    def key(c: Candidate) -> tuple[float, int, int, int]:
        score = affinity_score(c, prompt_blocks, capacity, load_weight, kv_weight)
        return (-round(score, 9), c.lora_affinity, c.load, -tie[c.replica_id])

    ranked = sorted(eligible, key=key)
    best_match = max((c.matched_blocks for c in eligible), default=0)
    reason = "affinity" if best_match > 0 and ranked[0].matched_blocks == best_match else "load"
    if best_match == 0 and index_stale:
        ranked = sorted(eligible, key=lambda c: -tie[c.replica_id])
        reason = "hash"
    if sticky_replica is not None:
        sticky = [c for c in ranked if c.replica_id == sticky_replica]
        if sticky:
            ranked = sticky + [c for c in ranked if c.replica_id != sticky_replica]
            reason = "sticky"
    # Over-bound replicas stay at the tail: only used when every eligible one failed.
    ranked += sorted(over, key=lambda c: (c.load, -tie[c.replica_id]))
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks, reason)


def weighted_scores(candidates: Sequence[Candidate], prompt_blocks: int) -> dict[str, float]:
    """llm-d-style scorers, each in [0, 1], summed with WEIGHTS."""
    loads = [c.load for c in candidates]
    low, high = min(loads), max(loads)
    scores = {}
    for c in candidates:
        prefix = c.matched_blocks / prompt_blocks if prompt_blocks else 0.0
        queue = 1.0 if high == low else (high - c.load) / (high - low)
        kv = 1.0 - min(max(c.kv_usage, 0.0), 1.0)
        scores[c.replica_id] = WEIGHTS["prefix"] * prefix + WEIGHTS["queue"] * queue + WEIGHTS["kv"] * kv
    return scores


def weighted(candidates: Sequence[Candidate], prompt_blocks: int, hash_key: int | str) -> Decision:
    if not candidates:
        return Decision([], 0, "none")
    scores = weighted_scores(candidates, prompt_blocks)
    ranked = sorted(
        candidates,
        key=lambda c: (-round(scores[c.replica_id], 9), c.lora_affinity, -rendezvous_weight(hash_key, c.replica_id)),
    )
    best_match = max(c.matched_blocks for c in candidates)
    reason = "affinity" if best_match > 0 and ranked[0].matched_blocks == best_match else "load"
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks, reason)


def least_load(candidates: Sequence[Candidate], hash_key: int | str = 0) -> Decision:
    ranked = sorted(
        candidates,
        key=lambda c: (c.load, c.lora_affinity, c.kv_usage, -rendezvous_weight(hash_key, c.replica_id)),
    )
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks if ranked else 0, "load")


def round_robin(candidates: Sequence[Candidate], counter: int) -> Decision:
    """``counter`` is the caller's running request count; candidates are in a stable order."""
    if not candidates:
        return Decision([], 0, "none")
    start = counter % len(candidates)
    ranked = list(candidates[start:]) + list(candidates[:start])
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks, "round-robin")


def random_choice(candidates: Sequence[Candidate], rng: _random.Random) -> Decision:
    ranked = list(candidates)
    rng.shuffle(ranked)
    return Decision([c.replica_id for c in ranked], ranked[0].matched_blocks if ranked else 0, "random")


def decide(
    policy: str,
    candidates: Sequence[Candidate],
    *,
    prompt_blocks: int,
    hash_key: int | str,
    counter: int,
    rng: _random.Random,
    epsilon: float = 0.25,
    sticky_replica: str | None = None,
    index_stale: bool = False,
    prompt_tokens: int = 0,
    block_size: int = 16,
    ttft_epsilon: float | None = TTFT_EPSILON,
    ttft_overhead_s: float = 0.0,
    hold: OverloadHold | None = None,
    last_home: str | None = None,
) -> Decision:
    if policy == "predicted-ttft":
        return predicted_ttft_policy(
            candidates, prompt_tokens, block_size, hash_key, epsilon=ttft_epsilon, slack=epsilon,
            sticky_replica=sticky_replica, ttft_overhead_s=ttft_overhead_s, hold=hold, last_home=last_home,
        )
    if policy == "weighted":
        return weighted(candidates, prompt_blocks, hash_key)
    if policy == "prefix-affinity":
        return prefix_affinity(
            candidates,
            prompt_blocks,
            hash_key,
            epsilon=epsilon,
            sticky_replica=sticky_replica,
            index_stale=index_stale,
        )
    if policy == "round-robin":
        return round_robin(candidates, counter)
    if policy == "random":
        return random_choice(candidates, rng)
    if policy == "least-load":
        return least_load(candidates, hash_key)
    raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
