"""What the replicas' heartbeats (read from Redis by the feed) tell the router about each one.

Heartbeats bind a replica's base URL to the id its KV events carry, give each model's block size
and each replica's load and rates, and, by going missing while Redis answers, say a replica is
gone before its health checks notice. Without a feed (no --redis), or while Redis is down, the
table says nothing and health checks alone decide.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.replicas import Replica, ReplicaSet

if TYPE_CHECKING:
    from kvscale.router.redis_feed import RedisFeed

# A replica whose heartbeat has been missing this long (while Redis answers) is skipped.
HEARTBEAT_STALE_S = 3.0


class HeartbeatTable:
    def __init__(self, feed: RedisFeed | None = None) -> None:
        self.feed = feed  # set by the router's start when it has --redis
        # replica id -> the monotonic time its heartbeat was last seen
        self._seen: dict[str, float] = {}

    @property
    def index_stale(self) -> bool:
        """Redis is configured but not answering: the index is the last one read."""
        return self.feed is not None and not self.feed.healthy

    def get(self, replica_id: str) -> Heartbeat | None:
        """The replica's latest heartbeat, while Redis answers."""
        if self.feed is None or not self.feed.healthy:
            return None
        return self.feed.heartbeats.get(replica_id)

    def fold_into(self, replicas: ReplicaSet, block_sizes: dict[str, int]) -> None:
        """Bind replica ids to URLs, learn each model's block size and note who heartbeats."""
        if self.feed is None or not self.feed.healthy:
            return
        beats = self.feed.heartbeats
        replicas.bind_heartbeat_ids({hb.base_url: rid for rid, hb in beats.items() if hb.base_url})
        for hb in beats.values():
            if hb.block_size:
                block_sizes[hb.model] = hb.block_size
        now = time.monotonic()
        for replica_id in beats:
            self._seen[replica_id] = now

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet: when it was last seen no longer matters."""
        self._seen.pop(replica_id, None)

    def stale(self, replica: Replica) -> bool:
        """It heartbeated before and has not for a while, though Redis has been answering."""
        feed = self.feed
        if feed is None or not feed.healthy or feed.healthy_since is None:
            return False
        last_seen = self._seen.get(replica.replica_id)
        if last_seen is None:
            return False  # never published (no --redis): health checks alone decide
        now = time.monotonic()
        grace = HEARTBEAT_STALE_S
        return now - feed.healthy_since > grace and now - last_seen > grace

    def routable(self, replica: Replica) -> bool:
        return replica.healthy and not self.stale(replica)

    def replica_status(self, replica: Replica) -> str:
        """Why a replica is (not) routable, for /health: its health check's verdict, or a stale
        heartbeat."""
        if replica.status == "ok" and not replica.healthy:
            return "marked down after a failed request; waiting for the next health check"
        if replica.status == "ok" and self.stale(replica):
            return "heartbeat in Redis is stale"
        return replica.status
