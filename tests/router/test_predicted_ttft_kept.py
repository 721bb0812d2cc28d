"""A holder's prefix that the work sent there since will have pushed out of its LRU by the time the
request starts is no hit: the estimate computes the whole prompt there, and the hysteresis that
keeps a group through a short overload has no prefix to keep it for. The figures are a decision of
the simulated routing grid (bench.w3_grid, c4-p256-over-uniform-random: 288-token prompts, 16-token
blocks, 3 replicas of 32 KV blocks at 42 prefill tokens/s): the holder's 16 blocks were matched,
and the request found none of them when it started 26.8 s later. Pure functions, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvscale.router import policy
from kvscale.router.candidates import Candidate
from kvscale.router.hot_blocks import KEPT_LOOKBACK, HotBlocks

PROMPT, BLOCK, KV, RATE = 288, 16, 32, 42.0


def cand(rid: str, *, matched: int = 0, kept: int | None = None, queued: int = 0, load: int = 0) -> Candidate:
    return Candidate(rid, load, matched_blocks=matched, kept_blocks=kept, queued_prefill_tokens=queued,
                     prefill_tokens_per_s=RATE, kv_blocks=KV)


def test_hot_blocks_tell_what_of_a_prefix_the_lru_keeps_once_the_blocks_sent_since_are_in() -> None:
    hot = HotBlocks(window_s=30.0)
    hot.sent("r0", [1, 2, 3], now=0.0)  # the group's prefix (1, 2) and a suffix block
    hot.sent("r0", [10, 11, 12], now=1.0)
    hot.sent("r0", [20, 21, 22], now=2.0)
    # 7 distinct blocks newer than block 2: in 8 blocks one place is left, for the prefix's head.
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=8) == 1
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=9) == 2  # all nine fit
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=7) == 0
    assert hot.kept("r0", [1, 9], 1, kv_blocks=8) == 0  # 8 blocks newer than block 1
    # Unknown: no size, no match, a replica nothing was sent to, a prefix expired from the window.
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=0) is None
    assert hot.kept("r0", [1, 2, 9], 0, kv_blocks=8) is None
    assert hot.kept("r1", [1, 2, 9], 2, kv_blocks=8) is None
    hot.sent("r0", [30], now=31.5)  # blocks 1, 2, 3 (sent at 0) leave the 30 s window
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=8) is None
    hot.sent("r0", [1, 2, 4], now=32.0)  # the group sent again: its prefix is the newest
    assert hot.kept("r0", [1, 2, 9], 2, kv_blocks=3) == 2


def test_a_prefix_further_back_than_the_lookback_is_lost_only_where_the_lookback_spans_the_pool() -> None:
    hot = HotBlocks(window_s=30.0)
    hot.sent("r0", [1, 2], now=0.0)
    hot.sent("r0", list(range(100, 100 + KEPT_LOOKBACK + 10)), now=1.0)
    assert hot.kept("r0", [1, 2], 2, kv_blocks=KEPT_LOOKBACK) == 0  # the walk spans the whole pool
    assert hot.kept("r0", [1, 2], 2, kv_blocks=KEPT_LOOKBACK + 5) is None  # past the walk: unknown
    assert hot.kept("r0", [1, 2], 2, kv_blocks=4 * KEPT_LOOKBACK) == 2  # fewer sent since than room
    hot.sent("r0", [3, 4], now=2.0)
    hot.sent("r0", list(range(10, 20)), now=3.0)
    assert hot.kept("r0", [3, 4], 2, kv_blocks=4 * KEPT_LOOKBACK) == 2  # 10 back: found, no walk
    assert hot.kept("r0", [3, 4], 2, kv_blocks=11) == 1


def test_a_prefix_the_lru_will_have_lost_is_computed_in_full_in_the_estimate() -> None:
    kept = cand("r0", matched=16, queued=352)
    lost = replace(kept, kept_blocks=0)
    half = replace(kept, kept_blocks=8)
    assert policy.predicted_ttft(kept, PROMPT, BLOCK) == pytest.approx((352 + 32) / RATE)
    assert policy.predicted_ttft(lost, PROMPT, BLOCK) == pytest.approx((352 + 288) / RATE)
    assert policy.predicted_ttft(half, PROMPT, BLOCK) == pytest.approx((352 + 160) / RATE)


def test_a_holder_whose_prefix_will_be_gone_is_passed_over_at_once_not_after_the_hold() -> None:
    """The same holder, 1,000 tokens queued (its estimate 24.6 s against an idle replica's 6.9 s):
    where its LRU keeps the prefix, the overload has only just begun and the group stays through
    the hold (the hit it would get there is worth waiting for); where the blocks sent there since
    push the prefix out, it goes to the idle replica now."""
    hold = policy.OverloadHold(now=100.0, hold_s=20.0, since={})
    idle = [cand("r1"), cand("r2")]
    stays = policy.predicted_ttft_policy([cand("r0", matched=16, queued=1000, load=2), *idle], PROMPT, BLOCK,
                                         hash_key=7, hold=hold)
    assert stays.ranked[0] == "r0" and stays.reason == "affinity" and stays.judged == ("r0", True)
    moved = policy.predicted_ttft_policy([cand("r0", matched=16, kept=0, queued=1000, load=2), *idle], PROMPT,
                                         BLOCK, hash_key=7, hold=hold)
    assert moved.ranked[0] in ("r1", "r2") and moved.reason == "load"
    assert moved.spill is not None and moved.spill.holder == "r0"
