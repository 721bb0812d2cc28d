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
