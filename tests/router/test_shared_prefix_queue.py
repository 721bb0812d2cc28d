"""A replica's waiting prefill counts a shared prefix once (kvscale.router.prefill_ledger).

The engine's heartbeat counts each waiting prompt less the blocks cached now, so while a group's
first request waits to be admitted, every sibling queued behind it counts the group's prefix again;
the engine computes it once. The holder of a group whose requests arrive together then looked
overloaded exactly when they did, and the spill rule sent them elsewhere (the routing grid's bursty
"over" cells, docs/performance.md). Pure functions and in-memory parts, no clock."""

from __future__ import annotations

import time

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import Heartbeat
from kvscale.router import policy
from kvscale.router.candidates import Candidate
from kvscale.router.decision import candidate_view
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.in_flight import InFlight
from kvscale.router.metrics import RouterMetrics
from kvscale.router.prefill_ledger import (
    PrefillLedger,
    Sent,
    queued_prefill_tokens,
    shared_prefix_tokens,
    ttft_inputs,
    waiting_prefill,
)
from kvscale.router.replicas import Replica

BLOCK, PREFIX, SUFFIX = 16, 1024, 32  # the grid's 1,024-token group prefixes, 32-token suffixes
PROMPT = PREFIX + SUFFIX
RATE = 42.0  # prefill tokens/s, the grid's calibrated replica


def prompt(group: int, request: int) -> list[int]:
    return [1000 + group] * PREFIX + [5000 + request] * SUFFIX


def send(group: int, request: int, at: float, hit: int = 0, started_at: float | None = None) -> Sent:
    return Sent(PROMPT - hit, at, started_at=started_at, hashes=hash_prompt_blocks(prompt(group, request), BLOCK),
                prompt_tokens=PROMPT)


def burst(group: int = 1, n: int = 5) -> list[Sent]:
    """A group's run of ``n`` requests sent in one instant, the first computing the prefix and the
    others predicted to hit it (the index's prediction): 1,056 + 4 x 32 tokens to compute."""
    return [send(group, 0, 1.0)] + [send(group, i, 1.0, hit=PREFIX) for i in range(1, n)]


def test_siblings_waiting_behind_their_groups_first_request_count_the_prefix_once() -> None:
    # All five wait (not admitted): the heartbeat counted 5 x 1,056; the prefix four times too many.
    assert shared_prefix_tokens(5, 2.0, burst(), BLOCK) == 4 * PREFIX
    # Only the last three wait: the first two were admitted and their blocks are findable, so the
    # heartbeat counted the three at their suffix already.
    assert shared_prefix_tokens(3, 2.0, burst(), BLOCK) == 0
    # One waiting request shares with nobody waiting.
    assert shared_prefix_tokens(1, 2.0, burst(), BLOCK) == 0


def test_what_is_cached_or_not_shared_is_not_taken_off() -> None:
    sent = burst()
    # The replica confirmed the prefix's blocks (its KV events): the heartbeat left them out already.
    confirmed = set(sent[0].hashes[: PREFIX // BLOCK])
    assert shared_prefix_tokens(5, 2.0, sent, BLOCK, confirmed) == 0
    # Half of it confirmed: the other half still counted four times too many.
    half = set(sent[0].hashes[: PREFIX // BLOCK // 2])
    assert shared_prefix_tokens(5, 2.0, sent, BLOCK, half) == 4 * PREFIX // 2
    # Five groups' first requests share nothing: every prefix is work.
    distinct = [send(g, 0, 1.0) for g in range(5)]
    assert shared_prefix_tokens(5, 2.0, distinct, BLOCK) == 0
    # Sent after the heartbeat, or started before it: not among what it counted.
    late = burst()[:2] + [send(1, 7, 3.0, hit=PREFIX)]
    assert shared_prefix_tokens(3, 2.0, late, BLOCK) == PREFIX
    # The first started before the heartbeat: its prefix was cached then, the siblings counted
    # at their suffix.
    started = [send(1, 0, 1.0, started_at=1.5)] + burst()[1:]
    assert shared_prefix_tokens(4, 2.0, started, BLOCK) == 0


def test_a_prompt_is_never_all_cached() -> None:
    """Two copies of one prompt of whole blocks: the engine computes the second's last block."""
    tokens = [7] * 64
    same = [Sent(64, 1.0, hashes=hash_prompt_blocks(tokens, BLOCK), prompt_tokens=64) for _ in range(2)]
    assert shared_prefix_tokens(2, 2.0, same, BLOCK) == 48


def test_the_waiting_prefill_takes_the_repeats_off_the_heartbeat() -> None:
    sent = burst()
    counted = 5 * PROMPT  # what the engine reported: each waiting prompt in full
    assert waiting_prefill(counted, 5, 2.0, sent, BLOCK) == PROMPT + 4 * SUFFIX
    # The correction and our own corrections together never go below zero.
    assert waiting_prefill(100, 5, 2.0, sent, BLOCK) == 0
    # No heartbeat: our own sends, each less its predicted hit, already count the prefix once.
    assert waiting_prefill(None, 0, 0.0, sent, BLOCK) == PROMPT + 4 * SUFFIX
    # Once the first started, its own tokens come off as before and the siblings' repeats with them.
    sent[0].started_at = 2.5
    assert waiting_prefill(counted, 5, 2.0, sent, BLOCK) == 4 * SUFFIX


def holder_and_other(holder_queued: int) -> list[Candidate]:
    """The holder of the group (64 of the new prompt's 66 blocks predicted there) with the burst
    queued; another replica with two other groups' first requests queued (2 x 1,056 tokens)."""
    return [Candidate("holder", 5, matched_blocks=PREFIX // BLOCK, queued_prefill_tokens=holder_queued,
                      prefill_tokens_per_s=RATE),
            Candidate("other", 2, queued_prefill_tokens=2 * PROMPT, prefill_tokens_per_s=RATE)]


def test_a_groups_burst_stays_on_its_holder() -> None:
    """The sixth request of a burst. Counted as the heartbeat counts it, the holder reads
    (5 x 1,056 + 32) / 42 = 126.5 s against the other's 75.4 s + 24.4 s saved, times 1.25 for the
    estimates' error: 124.8 s, and the request spilled (the group's prefix copied, its hit lost).
    With the prefix counted once the holder reads 29.0 s: it keeps it."""
    beat = Heartbeat("holder", "m", "u", BLOCK, num_running=0, num_waiting=5, kv_blocks_active=0,
                     kv_blocks_total=0, timestamp=2.0, prefill_tokens_waiting=5 * PROMPT, prefill_tokens_per_s=RATE)
    ledger = PrefillLedger()
    for key, s in enumerate(burst()):
        ledger.sent(key, s.tokens, s.sent_at, s.hashes, s.prompt_tokens)
    queued = ttft_inputs(beat, ledger, now=2.5, heartbeat_time=2.0)["queued_prefill_tokens"]
    assert queued == PROMPT + 4 * SUFFIX
    decision = policy.predicted_ttft_policy(holder_and_other(queued), PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "holder" and decision.reason == "affinity" and decision.spill is None
    assert decision.judged == ("holder", False)
    # The heartbeat's figure as it was read before (the prefix once per waiting sibling): a spill.
    raw = queued_prefill_tokens(beat.prefill_tokens_waiting, 2.0, ledger.entries(2.5))
    assert raw == 5 * PROMPT
    before = policy.predicted_ttft_policy(holder_and_other(raw), PROMPT, BLOCK, hash_key=1)
    assert before.ranked[0] == "other" and before.spill is not None and before.spill.holder == "holder"


def test_a_holder_overloaded_with_other_work_still_spills() -> None:
    """The same queue made of five other groups' first requests: nothing is shared, the work is
    real, and the rule still passes the holder over."""
    distinct = [send(g, 0, 1.0) for g in range(2, 7)]
    assert waiting_prefill(5 * PROMPT, 5, 2.0, distinct, BLOCK) == 5 * PROMPT
    decision = policy.predicted_ttft_policy(holder_and_other(5 * PROMPT), PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "other" and decision.spill is not None


def test_a_candidate_reads_the_replicas_confirmed_blocks() -> None:
    """Through the router's own parts: the ledger InFlight keeps and the heartbeat table."""
    metrics = RouterMetrics("predicted-ttft")
    in_flight = InFlight(metrics.in_flight)
    heartbeats = HeartbeatTable()
    replica = Replica("http://holder", "holder", healthy=True)
    for i in range(5):
        tokens = prompt(1, i)
        in_flight.open(replica, PROMPT if i == 0 else SUFFIX, hashes=hash_prompt_blocks(tokens, BLOCK),
                       prompt_tokens=len(tokens))
    now = time.monotonic()
    beat = Heartbeat("holder", "m", "u", BLOCK, num_running=0, num_waiting=5, kv_blocks_active=0,
                     kv_blocks_total=400, timestamp=time.time(), prefill_tokens_waiting=5 * PROMPT,
                     prefill_tokens_per_s=RATE)
    beat.received = now + 1.0  # taken after our five sends
    heartbeats.feed = type("Feed", (), {"heartbeats": {"holder": beat}, "healthy": True,
                                        "healthy_since": now})()
    view = candidate_view(replica, 64, heartbeats, in_flight, now + 1.0)
    assert view.queued_prefill_tokens == PROMPT + 4 * SUFFIX
    # The replica reported the prefix stored: the heartbeat's figure left it out, nothing more is.
    stored = set(hash_prompt_blocks(prompt(1, 0), BLOCK)[: PREFIX // BLOCK])
    view = candidate_view(replica, 64, heartbeats, in_flight, now + 1.0, confirmed=stored)
    assert view.queued_prefill_tokens == 5 * PROMPT
