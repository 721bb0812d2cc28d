"""A spill needs room for its copy as a new prefix does: the other replica's recent traffic, not
only its hot blocks, claims the room the copy would take (kvscale.router.spill_rule.evicted_blocks;
docs/router.md, "predicted-ttft")."""

from __future__ import annotations

from dataclasses import replace

from kvscale.router import policy
from kvscale.router.policy import Candidate


def cand(rid: str, *, matched: int = 0, queued: int = 0) -> Candidate:
    return Candidate(rid, 0, matched_blocks=matched, queued_prefill_tokens=queued, prefill_tokens_per_s=1000.0)


def test_the_room_a_spill_needs_is_the_lesser_of_not_hot_and_not_recently_claimed():
    """A 528-token prompt needs 33 blocks. 100 blocks not hot: no eviction, whatever the traffic,
    while its recent traffic leaves room (60 of 100 claimed: 40 free). Recent traffic claiming 80
    of the 100 blocks (a group spilled there a moment ago: its blocks sent once, not hot yet) leaves
    20: 13 blocks of what was sent there are evicted. A replica that does not say its size
    (``kv_blocks`` 0) is judged by its hot blocks alone."""
    other = replace(cand("other"), free_blocks=100, kv_blocks=100)
    assert policy.evicted_blocks(replace(other, recent_blocks=60), 528, 16) == 0
    assert policy.evicted_blocks(replace(other, recent_blocks=80), 528, 16) == 13
    assert policy.evicted_blocks(replace(other, recent_blocks=200), 528, 16) == 33
    assert policy.evicted_blocks(replace(other, recent_blocks=200, kv_blocks=0), 528, 16) == 0
    # Blocks it holds already need no room.
    assert policy.evicted_blocks(replace(other, recent_blocks=80, matched_blocks=16), 528, 16) == 0


def test_a_holder_keeps_its_group_where_the_other_is_full_of_recent_traffic():
    """The holder's 1.5 s queue beats the idle other's 0.528 s plus the 0.512 s its 32 cached blocks
    save by 1.44x: with the other's 100 blocks not hot and not claimed, the request spills. The
    same other whose recent traffic claims all 100 blocks would evict 33 blocks for the copy (0.528 s
    more at its rate): the holder keeps the request, judged not overloaded."""
    holder = cand("holder", matched=32, queued=1500)
    empty = replace(cand("other"), free_blocks=100, kv_blocks=100)
    spilled = policy.predicted_ttft_policy([holder, empty], 528, 16, hash_key=6)
    assert spilled.ranked[0] == "other" and spilled.spill is not None
    claimed = replace(empty, recent_blocks=100)
    kept = policy.predicted_ttft_policy([holder, claimed], 528, 16, hash_key=6)
    assert kept.ranked[0] == "holder" and kept.spill is None and kept.judged == ("holder", False)


def throttled_fits(r2_homed: int = 4, r0_homed: int = 3) -> list[Candidate]:
    """From the simulated grid's c32-p256-fits-throttled-random cell (stream 0, its first spill):
    80 KV blocks a replica, 18 a prompt (a 256-token group prefix and a 32-token suffix). r0, at
    half speed, holds the group's 16 prefix blocks and is home to 3 groups; r1 and r2 are home
    to 4 each, their KV filled by them."""
    def rep(rid: str, rate: float, matched: int, queued: int, homed: int, recent: int) -> Candidate:
        return Candidate(rid, 0, matched_blocks=matched, queued_prefill_tokens=queued, prefill_tokens_per_s=rate,
                         free_blocks=32, kv_blocks=80, recent_blocks=recent, homed_groups=homed)
    return [rep("r0", 21.0, 16, 1088, r0_homed, 68), rep("r1", 42.0, 0, 640, 4, 88),
            rep("r2", 42.0, 0, 352, r2_homed, 88)]


def test_a_group_does_not_spill_where_it_would_evict_the_groups_homed_there():
    """r0's queue (53.3 s) truly overloads it against r2 (15.2 s plus the 12.9 s of the blocks the
    copy would lose and evict: 35.2 s with the slack). But r0's KV holds its 3 groups (54 blocks of
    80), and r2's 4 groups and this one would not fit in r2's (90 blocks): the copy would make r2
    home to a fifth group, evicted there by the others at every return. The holder keeps it."""
    kept = policy.predicted_ttft_policy(throttled_fits(), 288, 16, hash_key=6, last_home="r0")
    assert kept.ranked[0] == "r0" and kept.spill is None and kept.judged == ("r0", False)
    # Where r2 is home to 3 groups, the copy fits beside them: the request spills there.
    spilled = policy.predicted_ttft_policy(throttled_fits(r2_homed=3), 288, 16, hash_key=6, last_home="r0")
    assert spilled.ranked[0] == "r2" and spilled.spill is not None and spilled.spill.holder == "r0"
    # Or where r2 is the group's home already (its 4 groups count this one).
    home = policy.predicted_ttft_policy(throttled_fits(r0_homed=2), 288, 16, hash_key=6, last_home="r2")
    assert home.ranked[0] == "r2" and home.spill is not None
    # Where the holder's own groups overflow its KV (5 x 18 blocks > 80), the groups outgrow the
    # replicas anyway: the spill rule alone decides, as before.
    crowded = policy.predicted_ttft_policy(throttled_fits(r0_homed=5), 288, 16, hash_key=6, last_home="r0")
    assert crowded.ranked[0] == "r2" and crowded.spill is not None
    # A replica that does not say its KV size holds any number of groups.
    unknown = [replace(c, kv_blocks=0) for c in throttled_fits()]
    assert policy.predicted_ttft_policy(unknown, 288, 16, hash_key=6, last_home="r0").ranked[0] == "r2"
