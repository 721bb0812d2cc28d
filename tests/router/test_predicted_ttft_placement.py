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


def test_a_new_group_never_fills_a_replica_past_its_kv_blocks():
    """The claims are in blocks, speed aside: r1 claims least room (150 against r0's 200, r0 at
    half speed), but its KV is smaller and 150 + 66 blocks do not fit in its 200: the group goes to
    r0, where 200 + 66 fit in 320, rather than evicting one of r1's own groups (r2 has no room)."""
    fleet = [cand("r0", recent=200, free=192, rate=21.0), replace(cand("r1", recent=150, free=128), kv_blocks=200),
             cand("r2", recent=336, free=64)]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=7)
    assert decision.ranked[0] == "r0" and decision.reason == "load"
    # A replica whose KV size is unknown (no heartbeat yet) is taken to have room, as before.
    unknown = [replace(c, kv_blocks=0) for c in fleet]
    assert policy.predicted_ttft_policy(unknown, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"
    # Where the claims fit nowhere, the least claimed replica with room takes it.
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


def bursty_fleet(queued: int) -> list[Candidate]:
    """From the simulated grid's c32-p1024-fits-uniform-bursty cell: r1's groups have not come back
    within the hot window, so it claims least room (144 blocks against 228) and is the new group's
    home; ``queued``: the prefill waiting there (another new group's cold prompt: 1,088 tokens)."""
    return [cand("r0", recent=228, free=128, queued=320), cand("r1", recent=144, free=192, queued=queued),
            cand("r2", recent=228, free=128)]


def test_a_new_group_leaves_a_home_its_queue_truly_overloads():
    """r1 at 51.0 s, 2.03 times its own prefill of the prompt, against r2's 25.1 s (1.00): truly
    overloaded (2.03 > 1.25 x 1.00), so the group goes to r2, where it has room and fits (228 + 66
    blocks of 320). (The home took it, and the next new group, at once: p90 1.96 x cache_aware's.)"""
    decision = policy.predicted_ttft_policy(bursty_fleet(1088), PROMPT, BLOCK, hash_key=7)
    assert decision.ranked[0] == "r2" and decision.reason == "load"
    # A queue that is not a true overload keeps the home: 30.0 s is 1.19 times its own prefill.
    assert policy.predicted_ttft_policy(bursty_fleet(200), PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"
    # Scale-free: every replica ten times slower decides the same.
    slow = [replace(c, prefill_tokens_per_s=4.2) for c in bursty_fleet(1088)]
    assert policy.predicted_ttft_policy(slow, PROMPT, BLOCK, hash_key=7).ranked[0] == "r2"


def test_only_a_replica_with_room_takes_a_group_from_its_home_charged_what_it_evicts():
    """The overloaded home (51.0 s) keeps the group where no other replica has room beside its hot
    prefixes. Where the others have room but their recent traffic and the prompt overflow their KV
    blocks, each is charged the prefill of the blocks it would evict: 6 (260 + 66 of 320 blocks),
    2.3 s, leave r2 at 27.4 s and the home truly overloaded; all 66 (320 claimed), 25.1 s, leave
    r2 at 50.2 s, and the home keeps the group (51.0 s is not 1.25 x 50.2 s)."""
    no_room = bursty_fleet(1088)
    no_room[0], no_room[2] = replace(no_room[0], free_blocks=60), replace(no_room[2], free_blocks=60)
    assert policy.predicted_ttft_policy(no_room, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"
    no_fit = bursty_fleet(1088)
    no_fit[0], no_fit[2] = replace(no_fit[0], recent_blocks=260), replace(no_fit[2], recent_blocks=260)
    assert policy.predicted_ttft_policy(no_fit, PROMPT, BLOCK, hash_key=7).ranked[0] == "r2"
    full = bursty_fleet(1088)
    full[0], full[2] = replace(full[0], recent_blocks=320), replace(full[2], recent_blocks=320)
    assert policy.predicted_ttft_policy(full, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"


def test_the_one_replica_a_group_fits_in_is_passed_over_when_its_queue_truly_overloads_it():
    """From the simulated grid's c8-p1024-fits-throttled-random cell (seed 1, a new group at
    133.6 s): only r0, at half speed, fits its recent traffic and the prompt (208 + 66 of 320
    blocks), but five requests wait there behind 1,216 tokens: 108.2 s, 2.15 times its own prefill
    of the prompt. r2 has room beside its hot prefixes (128 blocks) but its recent traffic and the
    prompt overflow its KV by 22 blocks: 25.1 s, plus 8.4 s for those blocks' prefill, 1.33 times
    its own. r0 is truly overloaded and r2 takes the group. (Weighing only r0, where it fits, the
    waiting requests shared the group's 50 s prefill: TTFT p90 1.37 x the better baseline's.)"""
    fleet = [cand("r0", recent=208, free=128, rate=21.0, queued=1216), cand("r1", recent=280, free=64),
             cand("r2", recent=276, free=128)]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=7)
    assert decision.ranked[0] == "r2" and decision.reason == "load"
    # With a queue of one prompt there (1.52 times its own prefill) r0 keeps it.
    calm = [replace(fleet[0], queued_prefill_tokens=550), *fleet[1:]]
    assert policy.predicted_ttft_policy(calm, PROMPT, BLOCK, hash_key=7).ranked[0] == "r0"


def throttled_fleet(queued: int) -> list[Candidate]:
    """r0, at half speed, claims least room (70 + 66 blocks against 210 + 66 and 214 + 66)."""
    return [cand("r0", recent=70, free=250, rate=21.0, queued=queued), cand("r1", recent=210, free=110),
            cand("r2", recent=214, free=106)]


def test_a_slower_home_is_not_overloaded_for_being_slower():
    """Idle, r0's estimate is 50.3 s against the others' 25.1 s: by the spill rule on seconds it is
    overloaded, but that is its speed, which placed the group there; in units of each replica's own
    prefill both are 1.00, and the group stays. With another group's cold prompt queued there
    (100.6 s, 2.00 units) it is truly overloaded, and the group goes to r1."""
    assert policy.predicted_ttft_policy(throttled_fleet(0), PROMPT, BLOCK, hash_key=7).ranked[0] == "r0"
    assert policy.predicted_ttft_policy(throttled_fleet(1056), PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"


def test_a_home_is_never_passed_over_for_a_later_replica():
    """The other side of the units: r1, twice r0's speed, is the home and holds another group's
    cold prompt, 2.00 times its own prefill; r0, idle at half speed, is 1.00 times its own. The move
    would not make this request sooner (50.3 s against 50.3 s), so r1 keeps the group: the home is
    truly overloaded only when it is by the spill rule in seconds too."""
    fleet = [cand("r0", recent=200, free=120, rate=21.0), cand("r1", recent=100, free=220, queued=1056)]
    assert policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=7).ranked[0] == "r1"


def test_a_group_the_fleet_cannot_hold_is_placed_by_claims_not_by_the_one_replica_with_room():
    """From the simulated grid's c4-p256-over cell (256-token prefixes twice the fleet's KV, 32
    blocks a replica, 18 a prompt): r0's groups came back twice within the hot window (no room
    beside them), r2's one group too (16 blocks of room), r1's two not yet (room for all 32). Only
    r1 has room, but its two groups and the prompt (36 + 18 blocks) overflow it: no replica has
    room where the group fits, so room cannot choose and the least claimed replica takes it (r2),
    where by room alone r1 took this group and the next three, 6 groups against 3 and 3."""
    fleet = [Candidate(rid, 0, prefill_tokens_per_s=42.0, recent_blocks=recent, free_blocks=free, kv_blocks=32)
             for rid, recent, free in (("r0", 54, 0), ("r1", 36, 32), ("r2", 22, 16))]
    assert policy.predicted_ttft_policy(fleet, 288, BLOCK, hash_key=7).ranked[0] == "r2"


def test_a_returning_group_stays_home_through_an_overload_shorter_than_the_hold():
    """r1, the group's last home, is truly overloaded (50.3 s against r2's 25.1 s); as a holder is,
    it is passed over only once that has lasted the hold (15 s, the fleet's prefill wait), and the
    decision reports its verdict for the hysteresis."""
    fresh = policy.OverloadHold(100.0, 15.0, {})
    decision = policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="r1", hold=fresh)
    assert decision.ranked[0] == "r1" and decision.judged == ("r1", True)
    lasting = policy.OverloadHold(100.0, 15.0, {"r1": 80.0})
    assert policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="r1",
                                        hold=lasting).ranked[0] == "r2"
    # A home that is not overloaded ends the overload it was judged in.
    decision = policy.predicted_ttft_policy(over_capacity(), PROMPT, BLOCK, hash_key=7, last_home="r0", hold=fresh)
    assert decision.ranked[0] == "r0" and decision.judged == ("r0", False)


def test_with_no_room_anywhere_a_new_group_goes_where_fewest_groups_are_homed_per_unit_of_speed():
    """The c4-p256-over fleet above, with the groups each replica is home to (``homed_groups``): r1
    claims least recent room, but its groups merely had not come back within the hot window; it
    is home to 5 groups, r0 to 3 and r2 to 4, so the new group goes to r0 ((3 + 1) / 42 tokens/s).
    At half speed, r0's share counts double ((3 + 1) / 21 against r2's (4 + 1) / 42): r2 takes it.
    Equal shares go to the least claimed room, then the estimate."""
    def fleet(homed: tuple[int, int, int], r0_rate: float = 42.0) -> list[Candidate]:
        return [Candidate(rid, 0, prefill_tokens_per_s=rate, recent_blocks=recent, free_blocks=0, kv_blocks=32,
                          homed_groups=groups)
                for (rid, recent, rate), groups in zip((("r0", 54, r0_rate), ("r1", 20, 42.0), ("r2", 40, 42.0)),
                                                       homed, strict=True)]

    assert policy.predicted_ttft_policy(fleet((3, 5, 4)), 288, BLOCK, hash_key=7).ranked[0] == "r0"
    assert policy.predicted_ttft_policy(fleet((3, 5, 4), r0_rate=21.0), 288, BLOCK, hash_key=7).ranked[0] == "r2"
    assert policy.predicted_ttft_policy(fleet((4, 4, 4)), 288, BLOCK, hash_key=7).ranked[0] == "r1"
    # A group whose home is truly overloaded for the hold goes by the same share.
    lasting = policy.OverloadHold(100.0, 15.0, {"r1": 80.0})
    busy = [replace(c, queued_prefill_tokens=2000) if c.replica_id == "r1" else c for c in fleet((3, 5, 4))]
    moved = policy.predicted_ttft_policy(busy, 288, BLOCK, hash_key=7, last_home="r1", hold=lasting)
    assert moved.ranked[0] == "r0" and moved.judged == ("r1", True)


def test_with_no_room_anywhere_rates_that_differ_by_their_mix_alone_do_not_tilt_the_group_share():
    """Identical replicas publish prefill rates up to 1.7 x apart (a short moving average moved by
    its steps' mix): the real grid's c8-p1024-over cell, at 3, 4 and 4 groups homed, read 1,589,
    1,876 and 2,023 tokens/s, and weighed as read the twelfth group went to the replica home to 4
    ((4 + 1) / 2,023 < (3 + 1) / 1,589), ending 3, 4, 5. Within SAME_SPEED of the median the
    rates are one speed: the group goes to the replica home to 3. A replica at a third of the
    median still takes a third of the share."""
    def fleet(homed: tuple[int, int, int], rates: tuple[float, float, float]) -> list[Candidate]:
        return [Candidate(f"r{i}", 0, prefill_tokens_per_s=rate, recent_blocks=100, free_blocks=0, kv_blocks=128,
                          homed_groups=groups, last_homed=i)
                for i, (groups, rate) in enumerate(zip(homed, rates, strict=True))]

    decision = policy.predicted_ttft_policy(fleet((3, 4, 4), (1589.0, 1876.0, 2023.0)), 1059, BLOCK, hash_key=7)
    assert decision.ranked[0] == "r0"
    # The shares alone differ only by one group: the least homed, whatever the rates say within the band.
    assert policy.predicted_ttft_policy(fleet((4, 3, 4), (2023.0, 1589.0, 1876.0)), 1059, BLOCK,
                                        hash_key=7).ranked[0] == "r1"
    # A third of the median's speed is a slower replica: (2 + 1) / 600 > (4 + 1) / 1,876.
    slow = policy.predicted_ttft_policy(fleet((2, 4, 4), (600.0, 1876.0, 2023.0)), 1059, BLOCK, hash_key=7)
    assert slow.ranked[0] == "r1"


def test_among_equal_replicas_a_new_group_goes_where_a_group_last_made_its_home_longest_ago():
    """A burst of new groups arrives in one instant (32 in flight, 4,096-token prefixes twice the
    fleet's KV, the simulated grid): every replica is home to one group, claims as much room and
    has as long a queue. The next groups go round the replicas in the order they last took one
    (``last_homed``): a group two arrivals after another lands beside it, not beside the one just
    placed, whose cold prefill starts with its own. Left to the rendezvous hash, two groups placed
    one after the other shared a replica and waited on each other's prefill (TTFT p90 1.056 x
    cache_aware's, hit rate 0.93 x in random order, over 30 request streams; docs/performance.md,
    "The routing grid"). Both where the prompt fits (``new_prefix_home``) and where it fits
    nowhere (``shared_home``)."""
    def fleet(order: tuple[int, int, int], *, free: int, recent: int) -> list[Candidate]:
        return [Candidate(f"r{i}", 6, queued_prefill_tokens=4128, prefill_tokens_per_s=42.0, recent_blocks=recent,
                          free_blocks=free, kv_blocks=512, homed_groups=1, last_homed=last)
                for i, last in enumerate(order)]

    for order in ((1, 2, 3), (3, 1, 2), (2, 3, 1)):
        oldest = f"r{order.index(1)}"
        for hash_key in (7, 8, 9):
            nowhere = policy.predicted_ttft_policy(fleet(order, free=0, recent=268), 4128, BLOCK, hash_key=hash_key)
            assert nowhere.ranked[0] == oldest
            fits = policy.predicted_ttft_policy(fleet(order, free=512, recent=10), 160, BLOCK, hash_key=hash_key)
            assert fits.ranked[0] == oldest
