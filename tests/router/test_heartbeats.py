"""What the heartbeat table says with no feed, a feed that answers, and one that does not."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.heartbeats import HEARTBEAT_STALE_S, HeartbeatTable
from kvscale.router.replicas import Replica, ReplicaSet


def test_without_a_healthy_feed_health_checks_alone_decide() -> None:
    table = HeartbeatTable()
    replica = Replica("http://h:1", "h:1", healthy=True, status="ok")
    assert table.routable(replica) and not table.index_stale and table.get("h:1") is None
    table.feed = SimpleNamespace(heartbeats={}, healthy=False, healthy_since=None)
    assert table.index_stale and table.routable(replica)
    replica.healthy = False
    assert table.replica_status(replica) == ("marked down after a failed request; "
                                             "waiting for the next health check")


def test_heartbeats_bind_ids_teach_block_sizes_and_going_missing_makes_a_replica_stale() -> None:
    replicas = ReplicaSet()
    replicas.set_urls(["http://h:1"])
    (replica,) = replicas.replicas.values()
    replica.healthy, replica.status = True, "ok"
    beat = Heartbeat("replica-0", "m", "http://h:1/", 32, 0, 0, 0, 8, time.time())
    feed = SimpleNamespace(heartbeats={"replica-0": beat}, healthy=True,
                           healthy_since=time.monotonic() - 2 * HEARTBEAT_STALE_S)
    table = HeartbeatTable(feed)
    block_sizes: dict[str, int] = {}
    table.fold_into(replicas, block_sizes)
    assert replica.replica_id == "replica-0" and block_sizes == {"m": 32}
    assert table.get("replica-0") is beat and table.routable(replica)
    # Redis keeps answering, the replica's heartbeat stops coming.
    table._seen["replica-0"] -= 2 * HEARTBEAT_STALE_S
    assert not table.routable(replica)
    assert table.replica_status(replica) == "heartbeat in Redis is stale"
