"""The routing decisions, as pure functions on plain values."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvscale.router import policy
from kvscale.router.policy import Candidate


def test_bounded_capacity_is_ceil_of_one_plus_eps_times_mean_after():
    # 4 replicas, 15 in flight -> mean after one more = 4, cap = ceil(1.25 * 4) = 5
    assert policy.bounded_capacity([5, 4, 3, 3], 0.25) == 5
    assert policy.bounded_capacity([0, 0, 0, 0], 0.25) == 1
    assert policy.bounded_capacity([10, 0], 0.0) == 6
    assert policy.bounded_capacity([], 0.25) == 0


def test_affinity_picks_the_holder_of_the_longest_prefix():
    cands = [Candidate("a", 1, matched_blocks=2), Candidate("b", 1, matched_blocks=8), Candidate("c", 0)]
    decision = policy.prefix_affinity(cands, prompt_blocks=10, hash_key=123)
    assert decision.ranked[0] == "b"
    assert decision.matched_blocks == 8
    assert decision.reason == "affinity"
    assert sorted(decision.ranked) == ["a", "b", "c"]


def test_small_match_loses_to_a_much_less_loaded_replica():
    # 1 of 10 blocks cached is not worth queueing behind 4 requests
    cands = [Candidate("a", 4, matched_blocks=1), Candidate("b", 0), Candidate("c", 3)]
    decision = policy.prefix_affinity(cands, prompt_blocks=10, hash_key=1)
    assert decision.ranked[0] == "b"


def test_bounded_load_spills_a_hot_prefix():
    # "a" holds the whole prefix but already has 5 of 8 in flight: cap = ceil(1.25 * 9/4) = 3
    cands = [Candidate("a", 5, matched_blocks=10), Candidate("b", 1), Candidate("c", 1), Candidate("d", 1)]
    decision = policy.prefix_affinity(cands, prompt_blocks=10, hash_key=7)
    assert decision.ranked[0] != "a"
    assert decision.ranked[-1] == "a"  # kept only as a last resort for failover
    assert decision.matched_blocks == 0


def test_hot_prefix_spreads_when_simulated():
    """Send 40 requests of one prefix that stay in flight: no replica exceeds (1+eps) x mean."""
    loads = {"a": 0, "b": 0, "c": 0, "d": 0}
    held = {"a"}
    for _ in range(40):
        cands = [Candidate(r, loads[r], matched_blocks=10 if r in held else 0) for r in loads]
        cap = policy.bounded_capacity(list(loads.values()), 0.25)
        choice = policy.prefix_affinity(cands, 10, 99).ranked[0]
        assert loads[choice] + 1 <= cap
        loads[choice] += 1
        held.add(choice)
    assert max(loads.values()) <= 1.25 * (sum(loads.values()) / 4) + 1


def test_no_match_goes_to_least_loaded_then_hash_tiebreak_is_stable():
    cands = [Candidate("a", 2), Candidate("b", 0), Candidate("c", 0)]
    first = policy.prefix_affinity(cands, 4, hash_key=42)
    assert first.ranked[0] in {"b", "c"}
    assert first.reason == "load"
    # Same key, same answer, whatever the candidate order.
    again = policy.prefix_affinity(list(reversed(cands)), 4, hash_key=42)
    assert again.ranked[0] == first.ranked[0]


def test_stale_index_uses_consistent_hashing_for_unmatched_prompts():
    ids = [f"r{i}" for i in range(4)]
    cands = [Candidate(r, 0) for r in ids]
    picks = Counter()
    for key in range(400):
        decision = policy.prefix_affinity(cands, 4, hash_key=key, index_stale=True)
        assert decision.reason == "hash"
        assert decision.ranked[0] == policy.consistent_hash_order(key, ids)[0]
        picks[decision.ranked[0]] += 1
    assert all(60 < n < 140 for n in picks.values()), picks
    # Removing one replica moves only the keys that were on it.
    moved = sum(
        policy.consistent_hash_order(k, ids)[0] != policy.consistent_hash_order(k, ids[:3])[0] for k in range(400)
    )
    assert moved == picks["r3"]


def test_stale_index_still_prefers_a_known_holder():
    cands = [Candidate("a", 0), Candidate("b", 0, matched_blocks=3)]
    assert policy.prefix_affinity(cands, 4, hash_key=5, index_stale=True).ranked[0] == "b"


def test_sticky_session_wins_while_within_bound():
    cands = [Candidate("a", 1, matched_blocks=4), Candidate("b", 1)]
    decision = policy.prefix_affinity(cands, 4, hash_key=1, sticky_replica="b")
    assert decision.ranked[0] == "b" and decision.reason == "sticky"
    overloaded = [Candidate("a", 0), Candidate("b", 6), Candidate("c", 0)]
    assert policy.prefix_affinity(overloaded, 4, hash_key=1, sticky_replica="b").ranked[0] != "b"


def test_round_robin_cycles_in_order():
    cands = [Candidate("a", 9), Candidate("b", 0), Candidate("c", 0)]
    firsts = [policy.round_robin(cands, n).ranked[0] for n in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert policy.round_robin(cands, 1).ranked == ["b", "c", "a"]


def test_random_is_a_seeded_permutation():
    cands = [Candidate(r, 0) for r in "abcd"]
    one = policy.random_choice(cands, random.Random(3)).ranked
    two = policy.random_choice(cands, random.Random(3)).ranked
    assert one == two and sorted(one) == list("abcd")


def test_least_load_orders_by_load_then_kv_usage():
    cands = [Candidate("a", 2), Candidate("b", 1, kv_usage=0.9), Candidate("c", 1, kv_usage=0.1)]
    assert policy.least_load(cands).ranked == ["c", "b", "a"]


def test_decide_dispatches_and_rejects_unknown_policy():
    cands = [Candidate("a", 0, matched_blocks=2), Candidate("b", 0)]
    kwargs = dict(prompt_blocks=2, hash_key=1, counter=1, rng=random.Random(0))
    assert policy.decide("prefix-affinity", cands, **kwargs).ranked[0] == "a"
    assert policy.decide("round-robin", cands, **kwargs).ranked[0] == "b"
    assert policy.decide("least-load", cands, **kwargs).reason == "load"
    assert policy.decide("random", cands, **kwargs).reason == "random"
    with pytest.raises(ValueError, match="unknown routing policy"):
        policy.decide("fastest", cands, **kwargs)
    assert policy.prefix_affinity([], 1, 1).ranked == []


def test_effective_load_ignores_a_heartbeat_older_than_our_last_completion():
    # Fresh heartbeat: other routers' requests count too.
    assert policy.effective_load(2, 5, heartbeat_time=100.0, last_local_finish=99.0) == 5
    # Ours is the fresher count after a completion the heartbeat has not seen yet.
    assert policy.effective_load(2, 5, heartbeat_time=100.0, last_local_finish=100.5) == 2
    # A heartbeat never lowers what this router knows it has open.
    assert policy.effective_load(4, 1, heartbeat_time=100.0, last_local_finish=0.0) == 4
    assert policy.effective_load(3, None, heartbeat_time=0.0, last_local_finish=0.0) == 3
