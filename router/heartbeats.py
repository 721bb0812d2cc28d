"""What the replicas' heartbeats (read from Redis by the feed) tell the router about each one.

Heartbeats bind a replica's base URL to the id its KV events carry, give each model's block size
and each replica's load and rates, and, by going missing while Redis answers, say a replica is
gone before its health checks notice. Without a feed (no --redis), or while Redis is down, the
table says nothing and health checks alone decide.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.replicas import Replica, ReplicaSet

if TYPE_CHECKING:
    from kvscale.router.redis_feed import RedisFeed

# A replica whose heartbeat has been missing this long (while Redis answers) is skipped.
HEARTBEAT_STALE_S = 3.0
# Heartbeats per replica whose delays estimate its clock's offset from this router's.
OFFSET_SAMPLES = 64


class HeartbeatTable:
    def __init__(self, feed: RedisFeed | None = None) -> None:
        self.feed = feed  # set by the router's start when it has --redis
        # replica id -> the monotonic time its heartbeat was last seen
        self._seen: dict[str, float] = {}
        # replica id -> (heartbeat timestamp, received - timestamp) of its latest distinct heartbeats
        self._offsets: dict[str, deque[tuple[float, float]]] = {}

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
        for replica_id, hb in beats.items():
            self._seen[replica_id] = now
            self.local_time(hb)  # one offset sample per heartbeat, whether or not a decision reads it

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet: when it was last seen, and its clock, no longer matter."""
        self._seen.pop(replica_id, None)
        self._offsets.pop(replica_id, None)

    def local_time(self, heartbeat: Heartbeat) -> float:
        """When ``heartbeat`` was taken, on this router's monotonic clock.

        Its timestamp is the replica's wall clock, which may be seconds off this router's; compared
        as is with this router's times, a replica whose clock runs ahead sends heartbeats that look
        newer than they are. Like the Redis schema, which cuts off with one clock (the server's),
        this compares like with like: each heartbeat's delay, received (here) minus timestamp
        (there), is the skew plus the time it took to arrive; the smallest over recent heartbeats
        is the skew plus the shortest arrival, which is added to the timestamp.
        """
        samples = self._offsets.setdefault(heartbeat.replica_id, deque(maxlen=OFFSET_SAMPLES))
        if heartbeat.received > 0 and (not samples or samples[-1][0] != heartbeat.timestamp):
            samples.append((heartbeat.timestamp, heartbeat.received - heartbeat.timestamp))
        if not samples:  # a heartbeat not read from Redis: trust its clock
            return heartbeat.timestamp - (time.time() - time.monotonic())
        return heartbeat.timestamp + min(offset for _, offset in samples)

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
