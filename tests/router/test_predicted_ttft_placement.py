"""predicted-ttft's placement of a prompt nobody holds, from decisions of the simulated routing grid
(bench.w3_grid, 1,024-token prefixes, 3 replicas of 320 KV blocks): speed never fills a replica past
its KV blocks, and with no room anywhere a group returns to the replica it was last sent to. Pure
functions, no clock."""

from __future__ import annotations

from dataclasses import replace

from kvscale.router import policy
from kvscale.router.candidates import Candidate

PROMPT, BLOCK, KV = 1056, 16, 320  # a 1,024-token group prefix and a 32-token suffix: 66 blocks


def cand(rid: str, *, recent: int, free: int | None, rate: float = 42.0, queued: int = 0) -> Candidate:
    return Candidate(rid, 0, queued_prefill_tokens=queued, prefill_tokens_per_s=rate, recent_blocks=recent,
                     free_blocks=free, kv_blocks=KV)


def test_speed_does_not_fill_a_fast_replica_past_its_kv_blocks():
    """r0 runs at half speed: by claims per unit of speed r1 looks least claimed ((346 + 66) / 42
    against (140 + 66) / 21), but 346 + 66 blocks do not fit in its 320: the group goes to r0,
    where they do, rather than evicting one of r1's own groups (r2 has no room for it)."""
    fleet = [cand("r0", recent=140, free=192, rate=21.0), cand("r1", recent=346, free=128),
             cand("r2", recent=336, free=64)]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=7)
    assert decision.ranked[0] == "r0" and decision.reason == "load"
    # A replica whose KV size is unknown (no heartbeat yet) is taken to have room, as before.
    unknown = [replace(c, kv_blocks=0) for c in fleet]
    assert policy.predicted_ttft_policy(unknown, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"
    # Where the claims fit nowhere, speed decides among the replicas with room, as before.
    crowded = [replace(fleet[0], recent_blocks=300), fleet[1], fleet[2]]
    assert policy.predicted_ttft_policy(crowded, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"


def over_capacity() -> list[Candidate]:
    """No replica has room for 66 blocks beside its hot prefixes (the groups twice the fleet's KV);
    r2 has the shortest queue: 25.1 s against r0's 29.9 s and r1's 50.3 s."""
    return [cand("r0", recent=400, free=40, queued=200), cand("r1", recent=410, free=30, queued=1056),
            cand("r2", recent=390, free=50)]


def test_with_no_room_anywhere_a_group_returns_where_it_was_last_sent():
    assert policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7).ranked[0] == "r2"
    decision = policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="r0")
    assert decision.ranked[0] == "r0" and decision.spill is None
    # Unless the spill rule finds it truly overloaded: 50.3 s > 1.25 x 25.1 s.
    assert policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="r1").ranked[0] == "r2"
    # A home that left the fleet is no home.
    assert policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="gone").ranked[0] == "r2"


def test_room_comes_before_the_last_home():
    """Where a replica has room the group goes there, not back to a replica that evicted it."""
    fleet = over_capacity()
    fleet[1] = replace(fleet[1], free_blocks=200, recent_blocks=100)
    assert policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=7, last_home="r0").ranked[0] == "r1"


def test_the_return_is_scale_free():
    """Every replica ten times slower decides as the fast fleet."""
    slow = [replace(c, prefill_tokens_per_s=4.2) for c in over_capacity()]
    assert policy.predicted_ttft_policy(slow, PROMPT, BLOCK, hash_key=7, last_home="r0").ranked[0] == "r0"
    assert policy.predicted_ttft_policy(slow, PROMPT, BLOCK, hash_key=7, last_home="r1").ranked[0] == "r2"
