"""The KV index's wire types, on plain values: the heartbeat's JSON and the URLs logged."""

from __future__ import annotations

import json

import pytest

from kvscale.kv_index_schema import MAX_PUBLISHED_PRIORITIES, Heartbeat, redacted_url


def test_heartbeat_json_round_trip_and_old_payloads_read_as_unmeasured():
    beat = Heartbeat("r1", "m", "http://h:1", 16, 2, 3, 4, 64, timestamp=12.5, kv_blocks_cached=5,
                     prefill_tokens_waiting=700, num_decoding=2, prefill_tokens_per_s=1500.0, decode_step_s=0.03,
                     step_token_budget=512, running_by_priority={0: 1, 10: 3})
    back = Heartbeat.from_json("r1", beat.to_json(), received=99.0)
    assert back == Heartbeat(**{**beat.__dict__, "received": 99.0})
    assert back.load == 5 and back.kv_usage == pytest.approx(4 / 64)
    old = Heartbeat.from_json("r2", '{"model": "m", "num_running": 1, "timestamp": 3.0}', received=0.0)
    assert (old.prefill_tokens_per_s, old.prefill_tokens_waiting, old.num_running) == (0.0, 0, 1)
    assert old.running_by_priority == {}


def test_a_heartbeats_running_sequences_by_priority_are_read_bounded_and_of_integers_only():
    beat = Heartbeat.from_json("r", '{"running_by_priority": {"10": 3, "-2": 1, "x": 4, "5": "many", "7": -1}}', 0.0)
    assert beat.running_by_priority == {10: 3, -2: 1}
    many = Heartbeat.from_json("r", json.dumps({"running_by_priority": {str(p): 1 for p in range(100)}}), 0.0)
    # The least urgent levels are kept: they are the ones a more urgent request can displace.
    assert sorted(many.running_by_priority) == list(range(100 - MAX_PUBLISHED_PRIORITIES, 100))


def test_logged_redis_urls_hide_the_password():
    assert redacted_url("redis://:s3cret@chat-redis.team.svc:6379/0") == "redis://:***@chat-redis.team.svc:6379/0"
    assert redacted_url("rediss://user:pw@host/1") == "rediss://user:***@host/1"
    assert redacted_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
    # redis-py also takes the password as a query parameter
    assert redacted_url("redis://host:6379/0?password=s3cret&db=1") == "redis://host:6379/0?password=***&db=1"
    assert redacted_url("redis://u:pw@host/0?PASSWORD=s3cret") == "redis://u:***@host/0?PASSWORD=***"
