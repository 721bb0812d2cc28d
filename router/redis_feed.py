"""Keeps a router's PrefixIndex and heartbeat table in step with Redis (schema: kvscale.kv_index_schema).

Subscribes to the KV-event channel first, then reads every replica's (seq, blocks) atomically,
then applies messages whose seq follows the one it holds; a gap, a snapshot message or a
reconnect makes it reload that replica (or all of them). Every Redis call has a timeout in
milliseconds: when Redis is down the router keeps the last index (marked stale), logs once,
counts errors, and reloads everything when Redis answers again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from kvscale.kv_index_schema import (
    CLEARED,
    EVENTS_CHANNEL,
    REMOVED,
    REPLICAS_KEY,
    STORED,
    Heartbeat,
    blocks_key,
    event_tier,
    heartbeat_key,
    live_replicas_args,
    live_replicas_script,
    redacted_url,
    seq_key,
)
from kvscale.router.index import PrefixIndex

log = logging.getLogger("kvscale.router.redis")


class RedisFeed:
    def __init__(
        self,
        redis_url: str,
        index: PrefixIndex,
        *,
        timeout_s: float = 0.05,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        import redis.asyncio as aioredis

        self.redis_url = redis_url
        self.index = index
        self.timeout_s = timeout_s
        self.heartbeats: dict[str, Heartbeat] = {}
        self.healthy = False  # Redis answered the last call
        self.healthy_since: float | None = None  # monotonic time it last became healthy
        self._on_error = on_error or (lambda: None)
        self._client = aioredis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._live_members = live_replicas_script(self._client)
        self._members: set[str] = set()  # live membership as of the last read
        self._tasks: list[asyncio.Task] = []
        self._logged_down = False
        self.reloads = 0

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._events_loop(), name="redis-events"),
            asyncio.create_task(self._heartbeat_loop(), name="redis-heartbeats"),
        ]

    async def stop(self) -> None:
        # Bounded: a close that never returns (a CI run of the sigkilled-replica test hung here
        # for 15 minutes, the loop idle) must not hold up the router's shutdown.
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s * 40)
        try:
            await asyncio.wait_for(self._client.aclose(), self.timeout_s * 40)
        except Exception:  # the timeout included
            pass

    def _failed(self, exc: BaseException) -> None:
        self._on_error()
        if self.healthy or not self._logged_down:
            log.warning(
                "redis %s unreachable (%s); routing on the last index + consistent hashing",
                redacted_url(self.redis_url), exc,
            )
            self._logged_down = True
        self.healthy = False
        self.healthy_since = None

    def _recovered(self) -> None:
        if not self.healthy and self._logged_down:
            log.warning("redis %s is back; index reloaded", redacted_url(self.redis_url))
        self._logged_down = False
        if not self.healthy:
            self.healthy_since = time.monotonic()
        self.healthy = True

    # -- snapshot reads --------------------------------------------------------------------
    async def reload_replica(self, replica_id: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.get(seq_key(replica_id))
        pipe.smembers(blocks_key(replica_id))
        seq_raw, members = await asyncio.wait_for(pipe.execute(), self.timeout_s * 20)
        self.index.replace(replica_id, (int(m) for m in members), int(seq_raw or 0))
        self.reloads += 1

    async def live_members(self) -> set[str]:
        """Live replica ids; expired ones are pruned (with their keys) on the way."""
        raw = await asyncio.wait_for(
            self._live_members(keys=[REPLICAS_KEY], args=live_replicas_args()), self.timeout_s * 4
        )
        members = {m.decode() for m in raw}
        # A member that expired since the last read leaves the index even if its gone message was lost.
        for replica_id in self._members - members:
            self.index.forget(replica_id)
            self.heartbeats.pop(replica_id, None)
        self._members = members
        return members

    async def reload_all(self) -> None:
        replica_ids = await self.live_members()
        for replica_id in set(self.index.replica_ids()) - replica_ids:
            self.index.forget(replica_id)
        for replica_id in replica_ids:
            await self.reload_replica(replica_id)

    # -- event stream --------------------------------------------------------------------------
    async def apply(self, message: dict) -> None:
        replica_id = message["replica"]
        seq = int(message["seq"])
        if message.get("gone"):
            self.index.forget(replica_id)
            self.heartbeats.pop(replica_id, None)
            return
        held = self.index.seq(replica_id)
        if seq <= held and not message.get("snapshot"):
            return  # already in the snapshot we loaded
        if message.get("snapshot") or seq != held + 1:
            await self.reload_replica(replica_id)
            return
        for event in message.get("events", []):
            kind = event[0]
            if kind == STORED:
                self.index.stored(replica_id, event[1], event_tier(event))
            elif kind == REMOVED:
                self.index.removed(replica_id, event[1])
            elif kind == CLEARED:
                self.index.cleared(replica_id)
        self.index.set_seq(replica_id, seq)

    async def _events_loop(self) -> None:
        while True:
            pubsub = self._client.pubsub()
            try:
                await asyncio.wait_for(pubsub.subscribe(EVENTS_CHANNEL), self.timeout_s * 20)
                await self.reload_all()
                self._recovered()
                while True:
                    if not self.healthy:
                        # Another call failed meanwhile; what we hold may have missed changes.
                        await self.reload_all()
                        self._recovered()
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    await self.apply(json.loads(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
                await asyncio.sleep(0.5)
            finally:
                try:
                    await asyncio.wait_for(pubsub.aclose(), self.timeout_s * 20)
                except Exception:
                    pass

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self.poll_heartbeats()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failed(exc)
            await asyncio.sleep(0.5)

    async def poll_heartbeats(self) -> None:
        replica_ids = sorted(await self.live_members())
        if not replica_ids:
            self.heartbeats = {}
            return
        raw = await asyncio.wait_for(
            self._client.mget([heartbeat_key(rid) for rid in replica_ids]), self.timeout_s * 4
        )
        now = time.monotonic()
        beats: dict[str, Heartbeat] = {}
        for replica_id, payload in zip(replica_ids, raw, strict=True):
            if payload is None:
                continue  # expired: the replica stopped heartbeating
            beats[replica_id] = Heartbeat.from_json(replica_id, payload, now)
        self.heartbeats = beats
