"""predicted-ttft in a fleet's first burst: requests arrive in one instant, before any first token,
and the heartbeat counts every request queued behind a prefix still being computed in full. The
decisions below are taken from the simulated routing grid (bench.w3_grid, 32 requests in flight,
1,024-token prefixes, 3 replicas at 42 prefill tokens/s): pure functions, no clock."""

from __future__ import annotations

from dataclasses import replace

from kvscale.router import policy
from kvscale.router.candidates import Candidate

PROMPT, BLOCK = 1056, 16  # a 1,024-token group prefix and a 32-token suffix


def cand(rid: str, *, matched: int = 0, load: int = 0, recent: int = 0, free: int | None = 320,
         rate: float = 42.0) -> Candidate:
    # Every request queued there counted in full, as the heartbeat counts them mid-burst.
    return Candidate(rid, load, matched_blocks=matched, queued_prefill_tokens=load * PROMPT,
                     prefill_tokens_per_s=rate, recent_blocks=recent, free_blocks=free)


def burst_holder() -> list[Candidate]:
    """The holder of two groups has eight of their requests queued (8,448 tokens counted, ~2,300
    to compute): 201.9 s against the other's 125.7 s + 24.4 s saved, overloaded by the rule."""
    return [cand("holder", matched=64, load=8, recent=208, free=128), cand("other", load=4, recent=200, free=256),
            cand("third", load=5, recent=202, free=192)]


def test_the_first_burst_does_not_move_a_group_off_its_holder():
    now = 0.0
    first = policy.OverloadHold(now, 0.0, {})  # no first token yet: no wait measured
    decision = policy.predicted_ttft_policy(burst_holder(), PROMPT, BLOCK, hash_key=1, hold=first)
    assert decision.ranked[0] == "holder" and decision.spill is None and decision.reason == "affinity"
    assert decision.judged == ("holder", True)  # the verdict is kept: the hysteresis starts now
    # Without the hysteresis (no hold passed) the same numbers spill, as before.
    assert policy.predicted_ttft_policy(burst_holder(), PROMPT, BLOCK, hash_key=1).ranked[0] == "other"


def test_an_overload_that_outlasts_the_predicted_wait_moves_the_group():
    """Still no wait measured: the hold is the other's estimate (125.7 s); the verdict held 100 s
    keeps the group, one held 130 s moves it."""
    def first(held_s: float) -> str:
        hold = policy.OverloadHold(1000.0, 0.0, {"holder": 1000.0 - held_s})
        return policy.predicted_ttft_policy(burst_holder(), PROMPT, BLOCK, hash_key=1, hold=hold).ranked[0]

    assert first(100.0) == "holder"
    assert first(130.0) == "other"
    # A measured wait, once there is one, is the hold (as before): 20 s held against 15 s moves it.
    measured = policy.OverloadHold(1000.0, 15.0, {"holder": 980.0})
    assert policy.predicted_ttft_policy(burst_holder(), PROMPT, BLOCK, hash_key=1, hold=measured).ranked[0] == "other"


def test_the_predicted_hold_scales_with_the_fleet():
    """Every replica ten times slower: the estimates, hence the hold, ten times longer."""
    slow = [replace(c, prefill_tokens_per_s=4.2) for c in burst_holder()]
    hold = policy.OverloadHold(2000.0, 0.0, {"holder": 2000.0 - 1000.0})  # held 1000 s < 1257 s
    assert policy.predicted_ttft_policy(slow, PROMPT, BLOCK, hash_key=1, hold=hold).ranked[0] == "holder"
    hold = policy.OverloadHold(2000.0, 0.0, {"holder": 2000.0 - 1300.0})
    assert policy.predicted_ttft_policy(slow, PROMPT, BLOCK, hash_key=1, hold=hold).ranked[0] == "other"


def test_no_wait_measured_or_predicted_means_no_hysteresis():
    hold = policy.OverloadHold(5.0, 0.0, {})
    assert hold.outlasted("r0") and hold.outlasted("r0", 0.0)
    assert not hold.outlasted("r0", 3.0)
    assert policy.OverloadHold(5.0, 0.0, {"r0": 1.0}).outlasted("r0", 3.0)


def test_a_new_group_goes_to_the_least_claimed_replica_unless_its_queue_truly_overloads_it():
    """Mid-burst, r0 holds three groups with nine of their requests queued (counted in full:
    251.4 s, 10.0 times its own prefill of the prompt) and r1, r2 four groups each (226.3 s,
    201.1 s) in 320 KV blocks. The new group goes to r0, which has claimed least room (214 blocks
    against 272 and 270): r2 has room beside its hot prefixes, but its recent traffic and the
    prompt overflow its KV by 16 blocks, whose prefill (6.1 s) it is charged: 207.2 s, 8.2 times,
    and r0 is not truly overloaded (10.0 < 1.25 x 8.2). With eleven queued (301.7 s, 12.0 times)
    it is, and r2 takes the group (kvscale.router.cold_placement.busy_new_home)."""
    fleet = [replace(c, kv_blocks=320) for c in (cand("r0", load=9, recent=214, free=128),
                                                 cand("r1", load=8, recent=272, free=192),
                                                 cand("r2", load=7, recent=270, free=192))]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=78457)
    assert decision.ranked[0] == "r0" and decision.reason == "load"
    longer = [replace(fleet[0], load=11, queued_prefill_tokens=11 * PROMPT), *fleet[1:]]
    assert policy.predicted_ttft_policy(longer, PROMPT, BLOCK, hash_key=78457).ranked[0] == "r2"
    # Room still comes first: without room for the prompt's 66 blocks r0 is passed over for a
    # replica with room where the group fits (r2: 250 + 66 blocks of 320).
    fleet[0] = replace(fleet[0], free_blocks=60)
    fits = [fleet[0], fleet[1], replace(fleet[2], recent_blocks=250)]
    assert policy.predicted_ttft_policy(fits, PROMPT, BLOCK, hash_key=78457).ranked[0] == "r2"
    # Where no replica has both (r1 and r2 have room, but their claims and the prompt overflow
    # their KV), the groups outgrow the fleet: room cannot choose, the claims do, over every
    # replica (kvscale.router.cold_placement.cold_home).
    assert policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=78457).ranked[0] == "r0"
    # Equal claims: the estimate breaks the tie.
    even = [replace(c, recent_blocks=200, free_blocks=320) for c in fleet]
    assert policy.predicted_ttft_policy(even, PROMPT, BLOCK, hash_key=78457).ranked[0] == "r2"
