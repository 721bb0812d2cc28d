"""The replica-side KV event publisher and the router-side feed, against a real redis-server.

The events here are built by hand (BlockStored/BlockRemoved with the engine's block hashes); the
end-to-end tests drive the same path with a real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import redis

from kvscale.block_hash import hash_prompt_blocks
from kvscale.kv_index_schema import (
    MEMBERSHIP_TTL_S,
    REPLICAS_KEY,
    blocks_key,
    heartbeat_key,
    seq_key,
)
from kvscale.processes import wait_until
from kvscale.router.index import PrefixIndex
from kvscale.router.redis_feed import RedisFeed
from kvscale.server.engine.kv_publisher import KVEventPublisher
from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored, EngineStats


def stats(running: int = 1, waiting: int = 2) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=waiting, kv_blocks_total=64, kv_blocks_active=8,
        kv_blocks_cached=4, block_size=16, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
    )


def eventually(predicate, timeout: float = 10.0):
    return wait_until(predicate, timeout, interval=0.05)


class FakeCache:
    """Stands in for the engine's prefix cache: the set of hashes the events describe."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.snapshots = 0
        self.snapshot_threads: set[str] = set()

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()

    def snapshot(self) -> list[int]:
        self.snapshots += 1
        self.snapshot_threads.add(threading.current_thread().name)
        return sorted(self.held)


def members(client: redis.Redis, replica: str) -> set[int]:
    return {int(m) for m in client.smembers(blocks_key(replica))}


def step(publisher: KVEventPublisher, cache: FakeCache, events) -> None:
    cache.apply(events)
    publisher.on_step(events, stats(), cache.snapshot)


def test_events_snapshot_and_heartbeat_reach_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    client.sadd(blocks_key("r1"), 999)  # left over from a previous life: the first snapshot wipes it
    publisher = KVEventPublisher(redis_server.url, "r1", "m", "http://127.0.0.1:1", 16)
    cache = FakeCache()
    publisher.start()
    try:
        prompt = hash_prompt_blocks(list(range(80)), 16)
        # Until connected, steps only remember the stats; then a snapshot goes out.
        eventually(lambda: (step(publisher, cache, []), publisher.snapshots_published)[1] >= 1)
        assert members(client, "r1") == set()
        step(publisher, cache, [BlockStored(prompt, None, 16)])
        eventually(lambda: members(client, "r1") == set(prompt))
        step(publisher, cache, [BlockRemoved(prompt[3:])])
        eventually(lambda: members(client, "r1") == set(prompt[:3]))
        step(publisher, cache, [AllBlocksCleared()])
        eventually(lambda: members(client, "r1") == set())

        beat = json.loads(eventually(lambda: client.get(heartbeat_key("r1"))))
        assert beat["replica"] == "r1" and beat["model"] == "m" and beat["base_url"] == "http://127.0.0.1:1"
        assert (beat["num_running"], beat["num_waiting"], beat["kv_blocks_total"]) == (1, 2, 64)
        assert 0 < client.ttl(heartbeat_key("r1")) <= 5
        assert cache.snapshot_threads == {threading.current_thread().name}  # on the engine thread
    finally:
        publisher.stop()
    # A clean stop removes the replica so routers drop it at once.
    assert client.get(heartbeat_key("r1")) is None
    assert "r1" not in _membership(client)


def test_on_step_never_blocks_and_counts_drops_when_redis_hangs_then_is_gone(redis_server):
    """A hung Redis answers nothing, so a call that waited on it would take the socket timeout
    (2 s here); the bound is well under that and far over a busy CI machine's pauses (0.15 s)."""
    publisher = KVEventPublisher(redis_server.url, "r2", "m", "http://x", 16, queue_size=8,
                                 socket_timeout_s=2.0)
    cache = FakeCache()
    publisher.start()
    try:
        eventually(lambda: (step(publisher, cache, []), publisher.snapshots_published)[1] >= 1)
        worst = 0.0
        for outage in ("hung", "gone"):
            if outage == "hung":
                os.kill(redis_server.proc.pid, signal.SIGSTOP)
            else:
                redis_server.kill()  # SIGKILL ends a stopped process too
            # Flood: each call is tiny whatever Redis does.
            for i in range(1000):
                events = [BlockStored(hash_prompt_blocks(list(range(i, i + 32)), 16), None, 16)]
                started = time.perf_counter()
                step(publisher, cache, events)
                worst = max(worst, time.perf_counter() - started)
        assert worst < 1.0, f"on_step blocked for {worst * 1000:.1f} ms"
        eventually(lambda: not publisher.connected)
        assert publisher.redis_errors >= 1 and publisher.events_dropped > 0
    finally:
        publisher.stop()


def test_queue_overflow_drops_with_a_counter_and_resyncs(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    publisher = KVEventPublisher(redis_server.url, "r3", "m", "http://x", 16, queue_size=2)
    cache = FakeCache()
    publisher.start()
    try:
        eventually(lambda: (step(publisher, cache, []), publisher.snapshots_published)[1] >= 1)
        for i in range(200):  # far faster than the background thread drains a 2-slot queue
            step(publisher, cache, [BlockStored(hash_prompt_blocks(list(range(i, i + 16)), 16), None, 16)])
        assert publisher.events_dropped > 0
        # The next steps carry a snapshot; Redis ends equal to the cache.
        eventually(lambda: (step(publisher, cache, []), members(client, "r3") == cache.held)[1])
    finally:
        publisher.stop()


def test_redis_restart_resyncs_publisher_and_router_feed(redis_server):
    """Redis dies while the replica keeps caching; when it is back both sides converge."""
    client = redis.Redis.from_url(redis_server.url)
    publisher = KVEventPublisher(redis_server.url, "r4", "m", "http://127.0.0.1:9", 16)
    cache = FakeCache()
    index = PrefixIndex()
    errors = []

    async def scenario() -> None:
        feed = RedisFeed(redis_server.url, index, timeout_s=0.05, on_error=lambda: errors.append(1))
        await feed.start()

        async def until(predicate, timeout=15.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                step(publisher, cache, [])  # the idle ~1/s call, faster here
                if predicate():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("condition not met")

        try:
            first = hash_prompt_blocks(list(range(64)), 16)
            await until(lambda: publisher.snapshots_published >= 1 and feed.healthy)
            step(publisher, cache, [BlockStored(first, None, 16)])
            await until(lambda: index.confirmed_blocks("r4") == set(first))
            await until(lambda: "r4" in feed.heartbeats and feed.heartbeats["r4"].load == 3)

            redis_server.kill()
            second = hash_prompt_blocks(list(range(500, 564)), 16)
            step(publisher, cache, [BlockRemoved(first[2:]), BlockStored(second, None, 16)])
            await until(lambda: not feed.healthy and not publisher.connected)
            # The router keeps what it knew.
            assert index.confirmed_blocks("r4") == set(first)

            redis_server.start()  # same port, empty
            await until(lambda: members(client, "r4") == cache.held and feed.healthy)
            await until(lambda: index.confirmed_blocks("r4") == cache.held)
            assert cache.held == set(first[:2]) | set(second)
            # Incremental events flow again after the resync.
            third = hash_prompt_blocks(list(range(900, 932)), 16)
            step(publisher, cache, [BlockStored(third, None, 16)])
            await until(lambda: index.confirmed_blocks("r4") == cache.held)
        finally:
            await feed.stop()

    publisher.start()
    try:
        asyncio.run(scenario())
    finally:
        publisher.stop()
    assert errors, "the feed counted no Redis errors during the outage"
    assert publisher.snapshots_published >= 2


def test_feed_reloads_on_a_sequence_gap(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    index = PrefixIndex()

    async def scenario() -> None:
        # The sequence logic, not the timeout, is under test: a slack one for a busy machine.
        feed = RedisFeed(redis_server.url, index, timeout_s=1.0)
        client.zadd(REPLICAS_KEY, {"r5": float(client.time()[0])})
        client.sadd(blocks_key("r5"), 11, 12)
        client.set("kvscale:replica:r5:seq", 7)
        await feed.reload_all()
        assert index.confirmed_blocks("r5") == {11, 12} and index.seq("r5") == 7
        await feed.apply({"replica": "r5", "seq": 7, "events": [["stored", [99]]]})  # old: ignored
        assert 99 not in index.confirmed_blocks("r5")
        await feed.apply({"replica": "r5", "seq": 8, "events": [["removed", [11]]]})
        assert index.confirmed_blocks("r5") == {12}
        # seq 9 was missed: the feed reloads from Redis instead of applying 10 blindly.
        client.sadd(blocks_key("r5"), 13)
        client.set("kvscale:replica:r5:seq", 10)
        await feed.apply({"replica": "r5", "seq": 10, "events": [["stored", [13]]]})
        assert index.confirmed_blocks("r5") == {11, 12, 13} and index.seq("r5") == 10
        await feed.apply({"replica": "r5", "seq": 11, "gone": True})
        assert "r5" not in index.replica_ids()
        await feed.stop()

    asyncio.run(scenario())


# A publisher in a process of its own, so the test can SIGKILL it as a crash would: no goodbye.
_CRASHING_PUBLISHER = """
import sys, time
from kvscale.server.engine.kv_publisher import KVEventPublisher
from kvscale.server.outputs import EngineStats
url, replica_id, hashes = sys.argv[1], sys.argv[2], [int(h) for h in sys.argv[3].split(",")]
publisher = KVEventPublisher(url, replica_id, "m", "http://127.0.0.1:9", 16)
publisher.start()
stats = EngineStats(num_running=0, num_waiting=0, kv_blocks_total=64, kv_blocks_active=0, kv_blocks_cached=3,
                    block_size=16, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
while True:
    publisher.on_step([], stats, lambda: hashes)  # the first connected step writes the snapshot
    time.sleep(0.05)
"""


def _membership(client: redis.Redis) -> set[str]:
    """Replica ids in kvscale:replicas, whatever Redis type the schema gives it."""
    kind = client.type(REPLICAS_KEY).decode()
    if kind == "set":
        return {m.decode() for m in client.smembers(REPLICAS_KEY)}
    if kind == "zset":
        return {m.decode() for m in client.zrange(REPLICAS_KEY, 0, -1)}
    return set()


def test_a_sigkilled_replica_leaves_membership_and_the_index_within_the_ttl(redis_server):
    """A crashed replica (no clean goodbye) must not stay in Redis forever."""
    client = redis.Redis.from_url(redis_server.url)
    dead_hashes = hash_prompt_blocks(list(range(48)), 16)
    child = subprocess.Popen(
        [sys.executable, "-c", _CRASHING_PUBLISHER, redis_server.url, "crasher", ",".join(map(str, dead_hashes))],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    survivor = KVEventPublisher(redis_server.url, "survivor", "m", "http://127.0.0.1:8", 16)
    cache = FakeCache()
    index = PrefixIndex()

    async def scenario() -> float:
        feed = RedisFeed(redis_server.url, index, timeout_s=0.05)
        await feed.start()

        async def until(predicate, timeout: float) -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                step(survivor, cache, [])
                if predicate():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("condition not met")

        try:
            await until(lambda: index.confirmed_blocks("crasher") == set(dead_hashes) and "crasher" in feed.heartbeats
                        and "survivor" in feed.heartbeats, 30)
            child.kill()  # SIGKILL: no goodbye, no last heartbeat
            child.wait(10)
            killed_at = time.monotonic()
            await until(lambda: "crasher" not in _membership(client), MEMBERSHIP_TTL_S + 3)
            await until(lambda: "crasher" not in index.replica_ids(), 3)
            gone_after = time.monotonic() - killed_at
            # Its keys are purged with its membership, not left to a long TTL.
            assert not client.exists(blocks_key("crasher"), seq_key("crasher"), heartbeat_key("crasher"))
            assert "crasher" not in feed.heartbeats
            # The live replica is untouched.
            assert "survivor" in _membership(client) and "survivor" in feed.heartbeats
            return gone_after
        finally:
            await feed.stop()

    survivor.start()
    try:
        gone_after = asyncio.run(scenario())
    finally:
        survivor.stop()
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert gone_after <= MEMBERSHIP_TTL_S + 3


def test_heartbeat_carries_queued_prefill_decodes_and_measured_rates(redis_server):
    """The fields predicted-ttft needs, measured from the engine's own counters step by step."""
    client = redis.Redis.from_url(redis_server.url)
    publisher = KVEventPublisher(redis_server.url, "r6", "m", "http://127.0.0.1:6", 16)
    cache = FakeCache()

    def busy(prompt_total: float, generated_total: float, waiting_tokens: int, decoding: int) -> EngineStats:
        s = stats(running=2, waiting=1)
        s.extra.update(prompt_tokens_computed_total=prompt_total, generation_tokens_total=generated_total,
                       prefill_tokens_waiting=float(waiting_tokens), num_decoding=float(decoding),
                       max_num_batched_tokens=2048.0)
        return s

    publisher.start()
    try:
        eventually(lambda: (step(publisher, cache, []), publisher.snapshots_published)[1] >= 1)
        prompt = generated = 0.0
        publisher.on_step([], busy(prompt, generated, 600, 2), cache.snapshot)
        for _ in range(6):  # decode-only steps of ~20 ms, then prefill steps of 256 tokens in ~0.1 s
            time.sleep(0.02)
            generated += 2
            publisher.on_step([], busy(prompt, generated, 600, 2), cache.snapshot)
        for _ in range(4):
            time.sleep(0.1)
            prompt += 256
            generated += 2
            publisher.on_step([], busy(prompt, generated, 600, 2), cache.snapshot)

        def measured():
            raw = client.get(heartbeat_key("r6"))
            beat = json.loads(raw) if raw else {}
            return beat if beat.get("prefill_tokens_per_s", 0) > 0 else None

        beat = eventually(measured)
        assert beat["prefill_tokens_waiting"] == 600 and beat["num_decoding"] == 2
        assert 0.015 < beat["decode_step_s"] < 0.2
        # ~256 tokens per ~0.08 s of prefill (the step less its decode): some 3,000 tok/s, loosely on a busy CPU.
        assert 500 < beat["prefill_tokens_per_s"] < 20000
        assert beat["step_token_budget"] == 2048
    finally:
        publisher.stop()
