"""The routing decisions, as pure functions on plain values."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

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


# -- predicted-ttft --------------------------------------------------------------------------------

def ttft_cand(rid: str, *, matched: int = 0, queued: int = 0, rate: float = 1000.0, decoding: int = 0,
              step: float = 0.0, per_step: float = 0.0, load: int = 0) -> Candidate:
    return Candidate(rid, load, matched_blocks=matched, queued_prefill_tokens=queued, prefill_tokens_per_s=rate,
                     num_decoding=decoding, decode_step_s=step, step_token_budget=per_step)


def test_predicted_ttft_is_queued_plus_uncached_over_rate_plus_decode_steps():
    # 528-token prompt, 32 blocks of 16 cached: 16 uncached + 100 queued at 1000 tok/s
    assert policy.predicted_ttft(ttft_cand("a", matched=32, queued=100), 528, 16) == pytest.approx(0.116)
    # Decodes running: every step carrying our prefill costs one decode step too; 600 tokens, 256 a step -> 3 steps
    c = ttft_cand("b", queued=72, decoding=4, step=0.05, per_step=256)
    assert policy.predicted_ttft(c, 528, 16) == pytest.approx(0.6 + 3 * 0.05)
    # A fully cached prompt still computes one token.
    assert policy.predicted_ttft(ttft_cand("c", matched=33), 528, 16) == pytest.approx(0.001)
    # Unmeasured replica: the default rate stands in.
    assert policy.predicted_ttft(ttft_cand("d", rate=0.0), 500, 16, default_rate=500.0) == pytest.approx(1.0)


def test_predicted_ttft_keeps_a_cached_prefix_despite_one_more_short_decode():
    """The issue's case: request counting spilled a cached prompt because the holder had one more
    request in flight, though that request was a short decode."""
    holder = ttft_cand("holder", matched=32, decoding=5, step=0.03, per_step=2048, load=5)
    others = [ttft_cand(f"r{i}", decoding=n, step=0.03, per_step=2048, load=n) for i, n in enumerate((3, 4, 3))]
    decision = policy.predicted_ttft_policy([*others, holder], 528, 16, hash_key=1)
    assert decision.ranked[0] == "holder" and decision.reason == "affinity"
    # Request counting under the bounded-load rule (eps = 0.25) spills it: cap = ceil(1.25 * 16 / 4) = 5.
    counted = [Candidate(c.replica_id, c.load, matched_blocks=c.matched_blocks) for c in [*others, holder]]
    assert policy.prefix_affinity(counted, 33, 1).ranked[0] != "holder"


def test_the_decision_carries_the_estimate_of_its_first_choice():
    """What the router reports as x-kvscale-predicted-ttft-ms, so its error can be measured."""
    holder = ttft_cand("holder", matched=32, queued=4000)
    other = ttft_cand("other", queued=0)
    decision = policy.predicted_ttft_policy([holder, other], 528, 16, hash_key=1)
    rates = policy.pool_rates([holder, other])
    expected = policy.predicted_ttft(replace(other, prefill_tokens_per_s=rates["other"]), 528, 16)
    assert decision.ranked[0] == "other" and decision.predicted_ttft_s == pytest.approx(expected)
    assert policy.round_robin([holder, other], 0).predicted_ttft_s is None


def test_predicted_ttft_leaves_a_holder_whose_queue_costs_more_than_the_prefill():
    holder = ttft_cand("holder", matched=32, queued=4000)  # 4 s of prefill queued
    other = ttft_cand("other", queued=0)  # 0.528 s to prefill from scratch
    assert policy.predicted_ttft_policy([holder, other], 528, 16, hash_key=1).ranked[0] == "other"


def test_predicted_ttft_weighs_each_replicas_measured_rate():
    slow = ttft_cand("slow", rate=200.0)
    fast = ttft_cand("fast", rate=2000.0, queued=1000)  # (1000+528)/2000 = 0.76 s < 528/200 = 2.6 s
    assert policy.predicted_ttft_policy([slow, fast], 528, 16, hash_key=3).ranked[0] == "fast"


def test_predicted_ttft_ties_go_to_the_longer_prefix_then_the_hash():
    a = ttft_cand("a", matched=1, queued=16)
    b = ttft_cand("b", matched=2)  # same work: 512 tokens either way
    assert policy.predicted_ttft_policy([a, b], 528, 16, hash_key=9).ranked[0] == "b"
    same = [ttft_cand("x"), ttft_cand("y"), ttft_cand("z")]
    first = policy.predicted_ttft_policy(same, 64, 16, hash_key=77).ranked[0]
    assert policy.predicted_ttft_policy(list(reversed(same)), 64, 16, hash_key=77).ranked[0] == first


def test_predicted_ttft_safety_valve_is_loose_and_can_be_off():
    # 14 in flight on the holder, 2 on each of 4 others: mean after = 23/5, cap(eps=2) = ceil(13.8) = 14
    holder = ttft_cand("h", matched=32, load=14)
    others = [ttft_cand(f"o{i}", load=2) for i in range(4)]
    capped = policy.predicted_ttft_policy([holder, *others], 528, 16, hash_key=1)
    assert capped.ranked[-1] == "h"
    assert policy.predicted_ttft_policy([holder, *others], 528, 16, hash_key=1, epsilon=None).ranked[0] == "h"
    # eps = 2 lets the holder go up to three times the mean: 9 + 1 <= ceil(3 * 18 / 5) = 11.
    near = ttft_cand("h", matched=32, load=9)
    assert policy.predicted_ttft_policy([near, *others], 528, 16, hash_key=1).ranked[0] == "h"


def test_unmeasured_replicas_borrow_the_pools_measured_rate():
    new = ttft_cand("new", rate=0.0)
    old = ttft_cand("old", rate=100.0, queued=50)  # the pool is slow: the new one is as slow
    # new: 528/100 = 5.28 s, old: 578/100 = 5.78 s
    assert policy.predicted_ttft_policy([old, new], 528, 16, hash_key=1).ranked[0] == "new"
    assert policy.decide("predicted-ttft", [old, new], prompt_blocks=33, hash_key=1, counter=0,
                         rng=random.Random(0), prompt_tokens=528, block_size=16).ranked[0] == "new"


# -- llm-d-style weighted scorer ---------------------------------------------------------------------

def test_weighted_scores_prefix_queue_and_kv_with_llm_d_weights():
    cands = [Candidate("a", 4, kv_usage=0.5, matched_blocks=10), Candidate("b", 0, kv_usage=0.0),
             Candidate("c", 2, kv_usage=1.0)]
    scores = policy.weighted_scores(cands, prompt_blocks=10)
    assert scores["a"] == pytest.approx(3 * 1.0 + 2 * 0.0 + 2 * 0.5)
    assert scores["b"] == pytest.approx(0 + 2 * 1.0 + 2 * 1.0)
    assert scores["c"] == pytest.approx(0 + 2 * 0.5 + 0)
    assert policy.weighted(cands, 10, hash_key=1).ranked == ["a", "b", "c"]
    # Equal queues score 1 each; a full match still outweighs an empty cache.
    assert policy.weighted([Candidate("x", 3), Candidate("y", 3, matched_blocks=5)], 10, 1).ranked[0] == "y"


def test_policies_list_has_the_new_default_and_keeps_the_baselines():
    assert policy.POLICIES[0] == policy.DEFAULT_POLICY == "predicted-ttft"
    assert {"prefix-affinity", "weighted", "round-robin", "random", "least-load"} <= set(policy.POLICIES)
    assert policy.uses_prefix("weighted") and not policy.uses_prefix("round-robin")


# -- predicted-ttft near the ceiling: keep a prefix where it is unless its holder is overloaded -------

def test_fits_a_holder_with_one_cold_prompt_queued_keeps_its_prefix():
    """The fleet holds every prefix; the holder has one cold 528-token prompt queued and another
    replica is idle. The raw minimum spills (544 vs 528 tokens of work: a 3 % gain for this request
    bought with a second copy of the prefix and 512 tokens more prefill on the fleet)."""
    holder = ttft_cand("holder", matched=32, queued=528, load=1)
    idle = ttft_cand("idle")
    decision = policy.predicted_ttft_policy([idle, holder], 528, 16, hash_key=5)
    assert decision.ranked == ["holder", "idle"]
    assert (decision.reason, decision.matched_blocks) == ("affinity", 32)
    # Two cold prompts queued: still within the prefill it saves (1040 < 1.25 * (528 + 512)).
    busier = ttft_cand("holder", matched=32, queued=1040, load=2)
    assert policy.predicted_ttft_policy([idle, busier], 528, 16, hash_key=5).ranked[0] == "holder"


def test_overloaded_holder_spills_to_the_soonest_other():
    # 3 s of queue on the holder against 0.528 s + 0.512 s saved on an idle one: truly overloaded.
    holder = ttft_cand("holder", matched=32, queued=3000, load=2)
    cands = [holder, ttft_cand("busy", queued=600, load=1), ttft_cand("idle")]
    decision = policy.predicted_ttft_policy(cands, 528, 16, hash_key=5)
    assert decision.ranked[0] == "idle" and decision.reason == "load" and decision.matched_blocks == 0


def test_slack_is_the_tolerated_prediction_error_before_a_spill():
    # holder 1.416 s, other 0.528 s + 0.512 s saved = 1.04 s: 1.36x beyond it.
    holder = ttft_cand("holder", matched=32, queued=1400)
    other = ttft_cand("other")
    assert policy.predicted_ttft_policy([holder, other], 528, 16, 1, slack=0.25).ranked[0] == "other"
    assert policy.predicted_ttft_policy([holder, other], 528, 16, 1, slack=0.5).ranked[0] == "holder"
    # decide() passes --balance-epsilon as the slack.
    kwargs = dict(prompt_blocks=33, hash_key=1, counter=0, rng=random.Random(0), prompt_tokens=528, block_size=16)
    assert policy.decide("predicted-ttft", [holder, other], epsilon=0.5, **kwargs).ranked[0] == "holder"
    assert policy.decide("predicted-ttft", [holder, other], epsilon=0.25, **kwargs).ranked[0] == "other"


def test_a_holders_low_measured_rate_does_not_spread_its_prefix():
    """A replica serving hits runs short prefill steps, so its measured tokens/s reads low (50 against
    400). Believed as is, its 116 tokens of work look like 2.3 s against 1.3 s for a cold prefill
    elsewhere; held within RATE_SPREAD of the pool's median it is 0.58 s and keeps the prefix."""
    holder = ttft_cand("holder", matched=32, queued=100, rate=50.0)
    others = [ttft_cand("a", rate=400.0), ttft_cand("b", rate=400.0)]
    assert policy.predicted_ttft_policy([*others, holder], 528, 16, hash_key=2).ranked[0] == "holder"
    assert policy.pool_rates([*others, holder]) == {"a": 400.0, "b": 400.0, "holder": 200.0}


def test_does_not_fit_a_cold_prompt_goes_where_it_evicts_no_hot_prefix():
    """Nobody holds the prompt; the idle replica's pool is full of hot prefixes, the other has room."""
    full = Candidate("full", 0, matched_blocks=0, prefill_tokens_per_s=1000.0, free_blocks=0)
    roomy = Candidate("roomy", 1, matched_blocks=0, queued_prefill_tokens=100, prefill_tokens_per_s=1000.0,
                      free_blocks=40)
    assert policy.predicted_ttft_policy([full, roomy], 528, 16, hash_key=3).ranked == ["roomy", "full"]
    # No replica has room: the soonest takes it (its LRU makes room there, one replica at a time).
    tight = replace(roomy, free_blocks=20)
    assert policy.predicted_ttft_policy([full, tight], 528, 16, hash_key=3).ranked[0] == "full"
    # Unknown room (no heartbeat yet) counts as room.
    unknown = replace(full, free_blocks=None)
    assert policy.predicted_ttft_policy([unknown, roomy], 528, 16, hash_key=3).ranked[0] == "full"


def test_a_session_stays_on_its_replica_unless_it_is_overloaded():
    home = ttft_cand("home", queued=300, load=2)
    idle = ttft_cand("idle")
    decision = policy.predicted_ttft_policy([idle, home], 528, 16, hash_key=4, sticky_replica="home")
    assert decision.ranked[0] == "home" and decision.reason == "sticky"
    swamped = ttft_cand("home", queued=5000, load=2)
    assert policy.predicted_ttft_policy([idle, swamped], 528, 16, 4, sticky_replica="home").ranked[0] == "idle"
    kwargs = dict(prompt_blocks=33, hash_key=4, counter=0, rng=random.Random(0), prompt_tokens=528, block_size=16)
    assert policy.decide("predicted-ttft", [idle, home], sticky_replica="home", **kwargs).ranked[0] == "home"


def test_a_holder_over_the_load_cap_goes_last_whatever_it_holds():
    holder = ttft_cand("holder", matched=32, load=14)
    others = [ttft_cand(f"o{i}", load=2) for i in range(4)]
    assert policy.predicted_ttft_policy([holder, *others], 528, 16, 1, sticky_replica="holder").ranked[-1] == "holder"


def test_cheap_hits_in_flight_do_not_trip_the_safety_valve():
    """Seven requests in flight on 3 replicas, six of them hits on the holder: at eps = 1 (the old
    default) the cap, ceil(2 * 8 / 3) = 6, passed the holder over though its queue is short."""
    holder = ttft_cand("holder", matched=32, queued=96, load=6)
    others = [ttft_cand("a", queued=528, load=1), ttft_cand("b")]
    assert policy.predicted_ttft_policy([*others, holder], 528, 16, hash_key=6).ranked[0] == "holder"


def test_the_spill_rule_is_scale_free_every_replica_equally_slow_decides_alike():
    """Every time the estimate compares is tokens over a rate or steps times a step: the same fleet
    ten times slower (rates / 10, decode steps x 10) decides the same, kept or spilled."""
    def fleet(slow: float, queued: int) -> list[Candidate]:
        holder = ttft_cand("holder", matched=32, queued=queued, rate=1000.0 / slow, decoding=2, step=0.05 * slow,
                           per_step=2048)
        return [holder, ttft_cand("idle", rate=1000.0 / slow, decoding=1, step=0.05 * slow, per_step=2048)]
    for queued, first in ((1000, "holder"), (3000, "idle")):
        fast = policy.predicted_ttft_policy(fleet(1.0, queued), 528, 16, hash_key=4)
        slow = policy.predicted_ttft_policy(fleet(10.0, queued), 528, 16, hash_key=4)
        assert fast.ranked[0] == slow.ranked[0] == first
        assert (fast.spill is None) == (slow.spill is None) == (first == "holder")


def test_a_spill_is_recorded_with_the_estimates_that_decided_it():
    holder = ttft_cand("holder", matched=32, queued=3000, load=2)
    decision = policy.predicted_ttft_policy([holder, ttft_cand("idle")], 528, 16, hash_key=5)
    assert decision.spill is not None
    assert (decision.spill.holder, decision.spill.other, decision.spill.held_blocks) == ("holder", "idle", 32)
    assert decision.spill.holder_ttft_s == pytest.approx(3.016)  # 3000 queued + 16 uncached at 1000/s
    assert decision.spill.other_ttft_s == pytest.approx(0.528)
    assert decision.spill.saved_s == pytest.approx(0.512)  # 32 blocks of 16 at the other's rate
    assert decision.judged == ("holder", True)


def test_a_spill_that_would_evict_hot_prefixes_counts_their_prefill():
    """The holder's 1.5 s queue beats 0.528 s + 0.512 s saved by 1.44x: spilled where the other has
    room. Where the other's pool is full of hot prefixes, the copy evicts 33 blocks that their own
    requests will compute again: 0.528 s more on the other side, and the holder keeps the prompt."""
    holder = ttft_cand("holder", matched=32, queued=1500)
    roomy = replace(ttft_cand("other"), free_blocks=100)
    full = replace(ttft_cand("other"), free_blocks=0)
    assert policy.predicted_ttft_policy([holder, roomy], 528, 16, hash_key=6).ranked[0] == "other"
    kept = policy.predicted_ttft_policy([holder, full], 528, 16, hash_key=6)
    assert kept.ranked[0] == "holder" and kept.spill is None and kept.judged == ("holder", False)
    assert policy.evicted_blocks(full, 528, 16) == 33 and policy.evicted_blocks(roomy, 528, 16) == 0


def test_hysteresis_keeps_the_group_through_a_short_overload_and_moves_it_after_a_long_one():
    """The rule finds the holder overloaded; it is passed over only once that verdict has held for
    hold_s (one prefill wait) without a break. No wait measured (hold_s 0): the predicted one holds
    (tests/router/test_predicted_ttft_burst.py)."""
    cands = [ttft_cand("holder", matched=32, queued=3000, load=2), ttft_cand("idle")]

    def first(hold: policy.OverloadHold | None) -> str:
        return policy.predicted_ttft_policy(cands, 528, 16, hash_key=5, hold=hold).ranked[0]

    assert first(policy.OverloadHold(now=100.0, hold_s=20.0, since={})) == "holder"  # it just began
    assert first(policy.OverloadHold(now=100.0, hold_s=20.0, since={"holder": 90.0})) == "holder"
    assert first(policy.OverloadHold(now=100.0, hold_s=20.0, since={"holder": 75.0})) == "idle"
    assert first(policy.OverloadHold(now=100.0, hold_s=0.0, since={})) == "holder"
    assert first(None) == "idle"
    kept = policy.predicted_ttft_policy(cands, 528, 16, hash_key=5, hold=policy.OverloadHold(100.0, 20.0, {}))
    assert kept.spill is None and kept.judged == ("holder", True) and kept.reason == "affinity"


def test_a_new_prefix_goes_where_recent_traffic_claims_least_room():
    """Nobody holds the prompt and every replica has room. r0 is idle but its recent traffic claims
    200 blocks (the prefixes it will be asked for again); r1 (100 tokens queued) and r2 (400) claim
    none: the sooner of them takes the prefix, the estimate breaking the tie. r1's queue is no true
    overload (0.628 s against r0's 0.528 s); r2's is (0.928 s > 1.25 x 0.528 s): alone with r0, the
    prefix goes to r0 (predicted_ttft.busy_new_home)."""
    room = dict(free_blocks=500)
    r0 = replace(ttft_cand("r0"), recent_blocks=200, **room)
    r1 = replace(ttft_cand("r1", queued=100, load=1), **room)
    r2 = replace(ttft_cand("r2", queued=400, load=1), **room)
    decision = policy.predicted_ttft_policy([r0, r1, r2], 528, 16, hash_key=7)
    assert decision.ranked[0] == "r1" and decision.reason == "load" and decision.spill is None
    assert policy.predicted_ttft_policy([r0, r2], 528, 16, hash_key=7).ranked[0] == "r0"
    r2_short = replace(r2, queued_prefill_tokens=100)
    assert policy.predicted_ttft_policy([r0, r2_short], 528, 16, hash_key=7).ranked[0] == "r2"
    # The claim is in blocks, speed aside: a replica at half the rate that claims less room takes
    # the prefix (40 + 33 < 60 + 33 blocks; per unit of speed it would have gone to "fast"), its
    # queue no true overload in units of its own prefill of the prompt.
    slow = replace(ttft_cand("slow", rate=500.0), recent_blocks=40, **room)
    fast = replace(ttft_cand("fast", rate=1000.0), recent_blocks=60, **room)
    mid = replace(ttft_cand("mid", rate=1000.0), recent_blocks=200, **room)
    assert policy.predicted_ttft_policy([slow, fast, mid], 528, 16, hash_key=7).ranked[0] == "slow"
    heavier = replace(slow, recent_blocks=80)  # 80 + 33 > 60 + 33: the fast one claims less
    assert policy.predicted_ttft_policy([heavier, fast, mid], 528, 16, hash_key=7).ranked[0] == "fast"


def test_a_new_prefix_is_placed_alike_on_a_fleet_ten_times_slower():
    """Estimates compared as ratios, room as blocks over rates: the scale cancels."""
    def fleet(slow: float) -> list[Candidate]:
        return [replace(ttft_cand(rid, queued=queued, rate=1000.0 / slow, decoding=1, step=0.05 * slow,
                                  per_step=2048), recent_blocks=recent, free_blocks=500)
                for rid, queued, recent in (("a", 0, 150), ("b", 80, 20), ("c", 60, 90))]
    fast, slow = (policy.predicted_ttft_policy(fleet(s), 528, 16, hash_key=3) for s in (1.0, 10.0))
    assert fast.ranked == slow.ranked and fast.ranked[0] == "b"
