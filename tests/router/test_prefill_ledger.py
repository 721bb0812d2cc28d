"""The router's in-flight prefill-token ledger, on plain values."""

from __future__ import annotations

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.prefill_ledger import (
    PrefillLedger,
    Sent,
    decoding_count,
    queued_prefill_tokens,
    ttft_inputs,
)


def test_sends_after_the_heartbeat_are_added_to_its_queue():
    sent = [Sent(500, sent_at=10.0), Sent(16, sent_at=10.5)]
    assert queued_prefill_tokens(1000, heartbeat_time=10.2, sent=sent) == 1000 + 16
    # Without a heartbeat, our own unstarted sends are all we know.
    assert queued_prefill_tokens(None, 0.0, sent) == 516


def test_requests_the_heartbeat_counted_and_that_started_since_are_taken_off():
    sent = [Sent(500, sent_at=9.0, started_at=10.4),  # counted by the 10.2 heartbeat, prefilled since
            Sent(300, sent_at=9.0, started_at=10.1),  # started before it: the heartbeat already left it out
            Sent(40, sent_at=10.3)]  # sent after it
    assert queued_prefill_tokens(800, heartbeat_time=10.2, sent=sent) == 300 + 40
    # Never below zero when the heartbeat had already seen less than we take off.
    assert queued_prefill_tokens(100, heartbeat_time=10.2, sent=sent) == 40
    # When the next heartbeat catches up, it alone counts what it saw.
    assert queued_prefill_tokens(0, heartbeat_time=10.6, sent=sent) == 0


def test_decoding_is_the_heartbeats_count_corrected_by_our_starts_and_finishes():
    sent = [Sent(1, 0.0, started_at=1.0), Sent(1, 0.0, started_at=3.0), Sent(1, 0.0),
            Sent(1, 0.0, started_at=1.5, finished_at=2.5)]
    # No heartbeat: ours that are decoding now.
    assert decoding_count(None, 0.0, sent) == 2
    # A heartbeat at t=2 saw 4 decoding (ours at 1.0 and 1.5 among them): the 1.5 one finished since,
    # the 3.0 one started since.
    assert decoding_count(4, 2.0, sent) == 4 - 1 + 1
    assert decoding_count(0, 2.0, sent) == 1
    # A heartbeat after all of it is taken as is.
    assert decoding_count(5, 4.0, sent) == 5


def test_ledger_tracks_open_requests_and_feeds_the_candidate_fields():
    ledger = PrefillLedger()
    ledger.sent(1, 512, now=100.0)
    ledger.sent(2, 16, now=100.5)
    ledger.started(1, now=100.8)
    beat = Heartbeat("r", "m", "u", 16, num_running=2, num_waiting=0, kv_blocks_active=1, kv_blocks_total=8,
                     timestamp=100.6, prefill_tokens_waiting=528, num_decoding=0, prefill_tokens_per_s=900.0,
                     decode_step_s=0.02, step_token_budget=400)
    fields = ttft_inputs(beat, ledger, now=101.0, heartbeat_time=beat.timestamp)
    # 528 seen by the heartbeat, less request 1 (started after it); request 2 was sent before it.
    # Two sequences ahead (the heartbeat's), no batch size published, nothing ended yet.
    assert fields == {"queued_prefill_tokens": 16, "num_decoding": 1, "prefill_tokens_per_s": 900.0,
                      "decode_step_s": 0.02, "step_token_budget": 400, "batch_slots": 0,
                      "sequences_ahead": 2, "decode_left_s": ()}
    ledger.done(1, now=101.2)
    ledger.done(2, now=101.2)  # never started (failed over): forgotten at once
    # Request 1 finished, but the 100.6 heartbeat still counts its prompt: it is still taken off.
    assert ttft_inputs(beat, ledger, now=101.5, heartbeat_time=100.6)["queued_prefill_tokens"] == 16
    # Once it is older than keep_s, a later heartbeat is assumed to have caught up.
    assert ttft_inputs(None, ledger, now=200.0, heartbeat_time=0.0) == {"queued_prefill_tokens": 0, "num_decoding": 0}
    assert ledger.entries(200.0) == []
