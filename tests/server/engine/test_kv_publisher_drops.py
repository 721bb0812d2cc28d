"""The Redis KV-event publisher's drops on /metrics: counted on a full queue and carried in every
step's stats to the front end (pure: the publisher is never started, nothing drains its queue;
tests/router/test_router_publisher.py runs it against a real Redis)."""

from __future__ import annotations

from kvscale.server.engine.kv_publisher import KVEventPublisher
from kvscale.server.entrypoints.metrics import ServerMetrics
from kvscale.server.outputs import BlockStored, EngineStats

BS = 16


def stats() -> EngineStats:
    return EngineStats(0, 0, 8, 0, 0, BS, 0, 0, 0)


def test_drops_reach_the_metrics_text_from_each_steps_stats() -> None:
    publisher = KVEventPublisher("redis://unused:6379/0", "r1", "m", "http://x", BS, queue_size=1)
    quiet = stats()
    publisher.on_step([], quiet, lambda: [1, 2])
    # Never connected: nothing queued, nothing dropped, and the metric reads 0.
    assert 'kvscale:kv_index_events_dropped_total{model_name="m"} 0.0' in ServerMetrics("m", lambda: quiet).render().decode()
    publisher._connected = True  # as the background thread sets it; it never runs here
    publisher.on_step([], stats(), lambda: [1, 2])  # the first snapshot fills the queue
    event = BlockStored([3], None, BS, token_ids=tuple(range(BS)))
    publisher.on_step([event, event], stats(), lambda: [1, 2, 3])  # dropped: 2 events
    publisher.on_step([event], stats(), lambda: [1, 2, 3])  # the resync's snapshot, dropped: 3 blocks
    last = stats()
    publisher.on_step([], last, lambda: [1, 2, 3])  # another snapshot, dropped: 3 more
    assert publisher.events_dropped == 8
    text = ServerMetrics("m", lambda: last).render().decode()
    assert 'kvscale:kv_index_events_dropped_total{model_name="m"} 8.0' in text
    # Absent from the stats (no --redis) it reads as 0.
    assert 'kvscale:kv_index_events_dropped_total{model_name="m"} 0.0' in ServerMetrics("m", stats).render().decode()
