"""predicted-ttft behind a preamble every prompt shares (a system prompt): the groups' own
prefixes follow the same opening blocks, which the first replica to serve them holds. The shape
of the routing grid's W3-lite behind a 64-token preamble (bench.w3_grid): 608-token prompts of 38
blocks, 4 of them the preamble. Pure functions, no clock."""

from __future__ import annotations

from kvscale.router import policy
from kvscale.router.candidates import Candidate
from kvscale.router.decision import GroupHomes, group_key

PROMPT, BLOCK = 608, 16  # a 64-token preamble, a 512-token group prefix, a 32-token suffix


def cand(rid: str, *, matched: int = 0, load: int = 0, recent: int = 0) -> Candidate:
    return Candidate(rid, load, matched_blocks=matched, queued_prefill_tokens=load * PROMPT,
                     prefill_tokens_per_s=42.0, recent_blocks=recent, free_blocks=320, kv_blocks=320)


def test_a_new_group_behind_a_shared_preamble_is_placed_as_a_new_one():
    """The preamble's first holder, idle, has claimed the most room; a new group goes where there
    is most (the least claimed), not to the holder of its four opening blocks (where it went
    before, and every group after it, until the spill rule found that replica overloaded)."""
    fleet = [cand("opener", matched=4, recent=150), cand("r1", recent=40), cand("r2", recent=80)]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "r1" and decision.reason == "load"


def test_a_group_whose_prefix_is_held_stays_on_its_holder():
    """Half the prompt's blocks or more held: the holder is the anchor, as any prefix's holder;
    fewer, for a group this router has not placed: placed as a new prefix."""
    for held in (19, 36):
        fleet = [cand("holder", matched=held, load=1, recent=150), cand("r1", matched=4, recent=40),
                 cand("r2", recent=80)]
        decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=1)
        assert decision.ranked[0] == "holder" and decision.reason == "affinity", held
    fleet = [cand("holder", matched=18, load=1, recent=150), cand("r1", recent=40), cand("r2", recent=80)]
    assert policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=1).ranked[0] == "r1"
    # A group this router placed before keeps a holder left with a few of its blocks (its LRU took
    # the rest): placed as a new prefix, the grid's throttled cells lost TTFT p90.
    fleet = [cand("holder", matched=4, recent=150), cand("r1", recent=40), cand("r2", recent=80)]
    decision = policy.predicted_ttft_policy(fleet, PROMPT, BLOCK, hash_key=1, last_home="r2")
    assert decision.ranked[0] == "holder" and decision.reason == "affinity"


def chained(blocks: list[int]) -> list[int]:
    """Stand-ins for chained block hashes: each one names its whole prefix."""
    out, acc = [], 0
    for block in blocks:
        acc = hash((acc, block))
        out.append(acc)
    return out


def test_groups_behind_one_preamble_are_remembered_apart_and_a_group_as_one():
    preamble = [1, 2, 3, 4]
    groups = [preamble + [100 * g + i for i in range(32)] for g in range(3)]
    keys = {group_key(chained(prefix + [9000 + n] * tail)) for n, tail in enumerate((1, 2, 3))
            for prefix in groups[:1]}
    assert len(keys) == 1  # one group, tails of 1-3 blocks: one key
    assert len({group_key(chained(prefix + [7])) for prefix in groups}) == 3
    assert group_key([]) is None and group_key([42]) == "42" and group_key([1, 2, 3]) == "1"
    homes = GroupHomes()
    for n, prefix in enumerate(groups):
        homes.remember(group_key(chained(prefix + [7])), f"r{n}")
    assert [homes.homed(f"r{n}") for n in range(3)] == [1, 1, 1]
