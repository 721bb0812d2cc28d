"""predicted-ttft counts the wait for a batch slot (docs/router.md, "predicted-ttft"): a replica
whose running sequences fill --max-num-seqs makes a new request wait for one of them to end, however
cheap its cached prefix makes the prefill. Pure functions, the ledger and the heartbeat as the router
builds them; no clock."""

from __future__ import annotations

import json

from kvscale.kv_index_schema import Heartbeat
from kvscale.router import policy
from kvscale.router.candidates import Candidate
from kvscale.router.predicted_ttft import slot_wait_s
from kvscale.router.prefill_ledger import PrefillLedger, decode_left, sequences_ahead, ttft_inputs

PROMPT, BLOCK = 600, 16  # a 512-token shared system prompt (32 blocks) and the user's turn
RATE, STEP = 400.0, 0.1  # prefill tokens/s and a decode step, every replica alike


def holder(slots: int, ahead: int = 2, left: tuple[float, ...] = (20.0, 25.0)) -> Candidate:
    """Holds the system prompt; ``ahead`` sequences decoding there, ``left`` seconds of each."""
    return Candidate("holder", ahead, matched_blocks=32, num_decoding=ahead, prefill_tokens_per_s=RATE,
                     decode_step_s=STEP, step_token_budget=2048, batch_slots=slots, sequences_ahead=ahead,
                     decode_left_s=left)


IDLE = Candidate("idle", 0, prefill_tokens_per_s=RATE, decode_step_s=STEP, step_token_budget=2048, batch_slots=2)


def test_a_full_batch_with_long_decodes_sends_the_request_to_the_idle_replica():
    decision = policy.predicted_ttft_policy([holder(slots=2), IDLE], PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "idle" and decision.spill is not None
    assert decision.spill.holder_ttft_s > 20.0  # the first slot frees in 20 s


def test_a_free_slot_keeps_the_request_on_the_holder():
    decision = policy.predicted_ttft_policy([holder(slots=3), IDLE], PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "holder" and decision.reason == "affinity" and decision.spill is None


def test_a_batch_about_to_free_a_slot_keeps_the_prefix_where_it_is():
    """The sooner decode ends within half a second: waiting for it costs less than prefilling the
    system prompt on the idle replica."""
    decision = policy.predicted_ttft_policy([holder(slots=2, left=(0.4, 25.0)), IDLE], PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "holder"


def test_a_replica_that_does_not_publish_its_batch_size_has_no_slot_wait():
    decision = policy.predicted_ttft_policy([holder(slots=0), IDLE], PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "holder"


def test_a_full_batch_moves_the_request_without_waiting_out_the_hysteresis():
    """The hold smooths over the heartbeat's miscount in a burst; a full batch is counted in
    requests, and its slot wait alone outweighs the idle replica: no hold."""
    hold = policy.OverloadHold(100.0, 5.0, {})  # a 5 s measured prefill wait, no overload seen yet
    decision = policy.predicted_ttft_policy([holder(slots=2), IDLE], PROMPT, BLOCK, hash_key=1, hold=hold)
    assert decision.ranked[0] == "idle" and decision.judged == ("holder", True)


def test_the_slot_wait_is_the_kth_slot_to_free():
    two = holder(slots=2, ahead=2, left=(3.0, 1.0))
    assert slot_wait_s(two) == 1.0  # one must end: the sooner
    assert slot_wait_s(holder(slots=2, ahead=3, left=(3.0, 1.0))) == 3.0  # two must end
    # Four ahead of two slots: the whole batch must end; the queue beyond it is in the queued prefill.
    assert slot_wait_s(holder(slots=2, ahead=4, left=(3.0, 1.0))) == 3.0
    assert slot_wait_s(holder(slots=2, ahead=9, left=(3.0, 1.0))) == 3.0
    assert slot_wait_s(holder(slots=3, ahead=2)) == 0.0
    # Sequences this router cannot tell (another router's) may end at the next step: a lower bound.
    assert slot_wait_s(holder(slots=4, ahead=4, left=(5.0,))) == STEP
    # A sequence past its typical length may end any step: at least one step.
    assert slot_wait_s(holder(slots=1, ahead=1, left=(0.0,))) == STEP


def test_the_ledger_counts_the_sequences_ahead_and_their_decoding_left():
    ledger = PrefillLedger()
    ledger.sent(1, 100, 0.0)
    ledger.sent(2, 100, 0.0)
    ledger.started(1, 1.0)
    ledger.started(2, 1.0)
    ledger.done(1, 3.0)  # decoded 2 s
    ledger.sent(3, 100, 3.5)  # after the heartbeat below
    assert ledger.typical_decode_s() == 2.0
    sent = ledger.entries(4.0)
    # The heartbeat at 0.5 counted ours 1 and 2 running; 1 ended since, 3 was sent since.
    assert sequences_ahead(2, 0.5, sent) == 2
    assert sequences_ahead(None, 0.5, sent) == 2
    # 2 has decoded 3 s, past the typical 2 s (may end any step); 3 has all 2 s ahead of it.
    assert decode_left(sent, ledger.typical_decode_s(), 4.0) == (0.0, 2.0)
    assert decode_left(sent, 0.0, 4.0) == ()  # nothing ended yet anywhere: unknown


def heartbeat(**extra: int) -> Heartbeat:
    payload = {"model": "m", "base_url": "u", "block_size": 16, "num_running": 2, "num_waiting": 1,
               "kv_blocks_active": 1, "kv_blocks_total": 8, "timestamp": 0.5, **extra}
    return Heartbeat.from_json("r", json.dumps(payload), received=0.5)


def test_the_heartbeat_carries_the_batch_size_and_an_old_one_reads_as_unknown():
    assert heartbeat(max_num_seqs=4).max_num_seqs == 4
    assert json.loads(heartbeat(max_num_seqs=4).to_json())["max_num_seqs"] == 4
    ledger = PrefillLedger()
    ledger.sent(1, 100, 1.0)  # after the heartbeat: not counted by it
    fields = ttft_inputs(heartbeat(max_num_seqs=4), ledger, now=2.0, heartbeat_time=0.5, fleet_decode_s=6.0)
    assert fields["batch_slots"] == 4 and fields["sequences_ahead"] == 4
    # None of ours ended here: the fleet's typical decode stands in.
    assert fields["decode_left_s"] == (6.0,)
    old = ttft_inputs(heartbeat(), ledger, now=2.0, heartbeat_time=0.5)
    assert old["batch_slots"] == 0 and slot_wait_s(Candidate("r", 3, **old)) == 0.0


def test_the_replicas_publisher_writes_its_engines_batch_size():
    from kvscale.server.engine.kv_publisher import KVEventPublisher
    from kvscale.server.outputs import EngineStats

    publisher = KVEventPublisher("redis://127.0.0.1:1", "r", "m", "http://x", 16)  # never started
    stats = EngineStats(num_running=2, num_waiting=0, kv_blocks_total=64, kv_blocks_active=0, kv_blocks_cached=0,
                        block_size=16, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                        extra={"max_num_seqs": 4.0, "max_num_batched_tokens": 512.0})
    publisher.on_step([], stats, lambda: [])
    beat = publisher.heartbeat()
    assert (beat.max_num_seqs, beat.step_token_budget) == (4, 512)


def test_where_every_batch_is_full_the_slot_wait_does_not_decide():
    """Both replicas full: the prefix stays with its holder, however long its decodes (the queues
    are compared by their prefill, as without the slot wait)."""
    busy = Candidate("busy", 2, num_decoding=2, prefill_tokens_per_s=RATE, decode_step_s=STEP, step_token_budget=2048,
                     batch_slots=2, sequences_ahead=2, decode_left_s=(0.5, 0.6))
    decision = policy.predicted_ttft_policy([holder(slots=2), busy], PROMPT, BLOCK, hash_key=1)
    assert decision.ranked[0] == "holder" and decision.spill is None
