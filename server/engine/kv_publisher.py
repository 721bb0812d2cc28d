"""A replica tells Redis which KV blocks it holds and how loaded it is, without ever waiting on it.

The schema it writes is kvscale.kv_index_schema. The engine thread calls ``on_step`` after every
step. It only appends to a bounded queue; a background thread talks to Redis. A full queue drops events (counted) and asks for a resync;
so does a Redis error. A resync is a full snapshot of the cached hashes, taken on the engine
thread inside the next ``on_step`` (the only place where the cache may be read safely) and
written by the background thread; queued events older than the snapshot are discarded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvscale.kv_index_schema import (
    BLOCKS_TTL_S,
    CLEARED,
    EVENTS_CHANNEL,
    HEARTBEAT_INTERVAL_S,
    REMOVED,
    REPLICAS_KEY,
    STORED,
    TIER_DEVICE,
    Heartbeat,
    blocks_key,
    events_message,
    gone_message,
    heartbeat_args,
    heartbeat_key,
    heartbeat_keys,
    heartbeat_script,
    lora_names,
    redacted_url,
    seq_key,
    snapshot_message,
)
from kvscale.server.core.step_rates import StepRates
from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored, EngineStats, KVEvent

if TYPE_CHECKING:
    import redis  # at run time, imported where it is used: on the background thread (``_run``)

log = logging.getLogger("kvscale.kv_publisher")
# The key of EngineStats.extra the drop counter travels under to the front end's /metrics
# (server/entrypoints/metrics.py); absent (no --redis) reads as 0.
STAT_EVENTS_DROPPED = "kv_index_events_dropped_total"


@dataclass
class _Batch:
    generation: int  # snapshot generation it was produced in; older ones are superseded
    events: list[list]  # [["stored", [...]], ["removed", [...]], ["cleared"]]


@dataclass
class _Snapshot:
    generation: int
    block_hashes: list[int]


_STOP = object()


def encode_events(events: list[KVEvent]) -> list[list]:
    encoded: list[list] = []
    for event in events:
        if isinstance(event, BlockStored | BlockRemoved):
            kind = STORED if isinstance(event, BlockStored) else REMOVED
            item: list = [kind, [int(h) for h in event.block_hashes]]
            if event.tier != TIER_DEVICE:
                item.append(event.tier)  # the host tier (kv_index_schema: absent means 1)
            encoded.append(item)
        elif isinstance(event, AllBlocksCleared):
            encoded.append([CLEARED])
    return encoded


class KVEventPublisher:
    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        model_name: str,
        base_url: str,
        block_size: int,
        *,
        queue_size: int = 4096,
        socket_timeout_s: float = 0.5,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self.redis_url = redis_url
        self.replica_id = replica_id
        self.model_name = model_name
        self.base_url = base_url
        self.block_size = block_size
        self.heartbeat_interval_s = heartbeat_interval_s
        self._socket_timeout_s = socket_timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Starts pending: the first snapshot replaces whatever a previous life left in Redis.
        self._resync_pending = threading.Event()
        self._resync_pending.set()
        self._generation = 0  # bumped (engine thread) each time a snapshot is queued
        self._latest_stats: EngineStats | None = None
        self._latest_stats_time = 0.0  # wall clock
        self._latest_stats_monotonic = 0.0
        self.rates = StepRates()
        self._connected = False
        self._heartbeat_script: Callable[..., Any] | None = None  # registered on first use
        # Counters, read by tests; events_dropped also by heartbeats and /metrics (``on_step``).
        self.events_dropped = 0
        self.events_published = 0
        self.snapshots_published = 0
        self.redis_errors = 0
        self.heartbeats_published = 0

    # -- engine thread ----------------------------------------------------------------------
    def on_step(
        self,
        events: list[KVEvent],
        stats: EngineStats,
        snapshot: Callable[[], list[int]],
    ) -> None:
        """Never blocks: O(len(events)) work and a non-blocking queue put. The step's ``stats``
        carry the drop count on every step: /metrics reads the newest stats, and a counter
        missing from them would read as a reset to 0."""
        self._publish(events, stats, snapshot)
        stats.extra[STAT_EVENTS_DROPPED] = float(self.events_dropped)

    def _publish(self, events: list[KVEvent], stats: EngineStats, snapshot: Callable[[], list[int]]) -> None:
        self._observe_step(stats)
        self._latest_stats = stats
        self._latest_stats_time = time.time()
        if self._resync_pending.is_set() and self._connected:
            # The snapshot already reflects this step's events; drop them.
            self._resync_pending.clear()
            self._generation += 1
            item = _Snapshot(self._generation, [int(h) for h in snapshot()])
            self._put(item, len(item.block_hashes))
            return
        if self._resync_pending.is_set() or not events:
            # While disconnected or waiting for a snapshot, single events are pointless:
            # the snapshot will carry their effect.
            return
        encoded = encode_events(events)
        if encoded:
            self._put(_Batch(self._generation, encoded), len(encoded))

    def _observe_step(self, stats: EngineStats) -> None:
        """Feed the step that produced ``stats`` to the rate averages.

        The engine reports its last step's duration (``last_step_s``); the prompt tokens it
        computed are the change in the cumulative counter since the previous call, and the
        sequences it decoded are those the previous call saw decoding. Without ``last_step_s``
        (an older engine) the interval between calls stands in, but only when the engine was busy
        at the previous call: an idle engine blocks on its queue, and that wait is no step.
        """
        now = time.monotonic()
        prev, prev_time = self._latest_stats, self._latest_stats_monotonic
        self._latest_stats_monotonic = now
        if prev is None:
            return
        prompt = stats.extra.get("prompt_tokens_computed_total", 0.0) - prev.extra.get("prompt_tokens_computed_total", 0.0)
        generated = stats.extra.get("generation_tokens_total", 0.0) - prev.extra.get("generation_tokens_total", 0.0)
        if prompt <= 0 and generated <= 0:
            return  # no step ran since the previous call (an idle tick, or only commands)
        step_s = stats.extra.get("last_step_s")
        if step_s is None:
            if prev.num_running + prev.num_waiting == 0:
                return
            step_s = now - prev_time
        self.rates.observe(step_s, prompt, int(prev.extra.get("num_decoding", 0)))

    def _put(self, item: object, size: int) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.events_dropped += size
            self._resync_pending.set()

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def resync_pending(self) -> bool:
        return self._resync_pending.is_set()

    # -- background thread ------------------------------------------------------------------
    def _run(self) -> None:
        import redis

        client = redis.Redis.from_url(
            self.redis_url,
            socket_timeout=self._socket_timeout_s,
            socket_connect_timeout=self._socket_timeout_s,
            health_check_interval=0,
        )
        next_heartbeat = 0.0
        logged_down = False
        try:
            while not self._stopping.is_set():
                if not self._connected:
                    try:
                        client.ping()
                    except redis.RedisError as exc:
                        self.redis_errors += 1
                        if not logged_down:
                            log.warning("redis %s unreachable (%s); serving goes on, will resync", redacted_url(self.redis_url), exc)
                            logged_down = True
                        self._drain()
                        if self._stopping.wait(0.5):
                            break
                        continue
                    if logged_down:
                        log.warning("redis %s is back; resyncing KV block snapshot", redacted_url(self.redis_url))
                    logged_down = False
                    self._drain()
                    self._resync_pending.set()
                    self._connected = True
                    next_heartbeat = 0.0
                try:
                    now = time.monotonic()
                    if now >= next_heartbeat:
                        self._heartbeat(client)
                        next_heartbeat = now + self.heartbeat_interval_s
                    timeout = max(0.0, next_heartbeat - time.monotonic())
                    try:
                        item = self._queue.get(timeout=timeout)
                    except queue.Empty:
                        continue
                    if item is _STOP:
                        break
                    self._write(client, item)
                except redis.RedisError as exc:
                    self.redis_errors += 1
                    self._connected = False
                    self._resync_pending.set()
                    log.warning("redis %s error (%s); serving goes on, will resync", redacted_url(self.redis_url), exc)
                    logged_down = True
            self._goodbye(client)
        finally:
            client.close()

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                self._stopping.set()
                return

    def _write(self, client: redis.Redis, item: object) -> None:
        if isinstance(item, _Snapshot):
            self._write_snapshot(client, item)
            return
        assert isinstance(item, _Batch)
        if item.generation < self._generation and self._resync_pending.is_set():
            return  # a newer snapshot is on its way and covers it
        # Coalesce whatever else is queued into one transaction.
        batches = [item]
        while len(batches) < 64:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if not isinstance(nxt, _Batch):
                self._flush_batches(client, batches)
                if nxt is _STOP:
                    self._stopping.set()
                    return
                self._write(client, nxt)
                return
            batches.append(nxt)
        self._flush_batches(client, batches)

    def _flush_batches(self, client: redis.Redis, batches: list[_Batch]) -> None:
        events = [event for batch in batches for event in batch.events]
        pipe = client.pipeline(transaction=True)
        key = blocks_key(self.replica_id)
        for event in events:
            if event[0] == STORED and event[1]:
                pipe.sadd(key, *event[1])
            elif event[0] == REMOVED and event[1]:
                pipe.srem(key, *event[1])
            elif event[0] == CLEARED:
                pipe.delete(key)
        pipe.incr(seq_key(self.replica_id))
        results = pipe.execute()
        seq = int(results[-1])
        # Published after EXEC so the message never runs ahead of the set it describes.
        client.publish(EVENTS_CHANNEL, events_message(self.replica_id, seq, events))
        self.events_published += len(events)

    def _write_snapshot(self, client: redis.Redis, snapshot: _Snapshot) -> None:
        key = blocks_key(self.replica_id)
        pipe = client.pipeline(transaction=True)
        pipe.delete(key)
        for start in range(0, len(snapshot.block_hashes), 4096):
            pipe.sadd(key, *snapshot.block_hashes[start : start + 4096])
        pipe.expire(key, BLOCKS_TTL_S)
        pipe.incr(seq_key(self.replica_id))
        results = pipe.execute()
        seq = int(results[-1])
        client.publish(EVENTS_CHANNEL, snapshot_message(self.replica_id, seq))
        self.snapshots_published += 1

    def heartbeat(self) -> Heartbeat:
        stats = self._latest_stats
        extra = stats.extra if stats else {}
        return Heartbeat(
            replica_id=self.replica_id,
            model=self.model_name,
            base_url=self.base_url,
            block_size=self.block_size,
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            kv_blocks_active=stats.kv_blocks_active if stats else 0,
            kv_blocks_total=stats.kv_blocks_total if stats else 0,
            kv_blocks_cached=stats.kv_blocks_cached if stats else 0,
            events_dropped=self.events_dropped,
            # When the stats were taken, not when this is written: routers compare it with
            # their own sends and completions.
            timestamp=self._latest_stats_time if stats else time.time(),
            prefill_tokens_waiting=int(extra.get("prefill_tokens_waiting", 0)),
            num_decoding=int(extra.get("num_decoding", 0)),
            prefill_tokens_per_s=round(self.rates.prefill_tokens_per_s, 3),
            decode_step_s=round(self.rates.decode_step_s, 6),
            step_token_budget=int(extra.get("max_num_batched_tokens", 0)),
            max_num_seqs=int(extra.get("max_num_seqs", 0)),
            # Which adapters this replica serves and holds on its device (docs/router.md, "LoRA
            # adapters"), each list bounded by the schema.
            lora_adapters=lora_names(stats.lora_adapters if stats else []),
            lora_resident=lora_names(stats.resident_lora_adapters if stats else []),
            lora_running=lora_names(stats.running_lora_adapters if stats else []),
            max_loras=int(extra.get("max_loras", 0)),
            running_by_priority=dict(stats.running_by_priority) if stats else {},
        )

    def _heartbeat(self, client: redis.Redis) -> None:
        script = self._heartbeat_script
        if script is None:
            script = self._heartbeat_script = heartbeat_script(client)
        rid = self.replica_id
        added = script(
            keys=heartbeat_keys(rid), args=heartbeat_args(rid, self.heartbeat().to_json()),
        )
        if int(added) and not self._resync_pending.is_set():
            # We were pruned while alive (stalled past the TTL): our block set is gone; rewrite it.
            log.warning("replica %s had expired from %s; resyncing its blocks", rid, REPLICAS_KEY)
            self._resync_pending.set()
        self.heartbeats_published += 1

    def _goodbye(self, client: redis.Redis) -> None:
        """Clean shutdown: routers drop this replica now instead of waiting for the TTL."""
        if not self._connected:
            return
        try:
            pipe = client.pipeline(transaction=True)
            pipe.delete(heartbeat_key(self.replica_id), blocks_key(self.replica_id))
            pipe.zrem(REPLICAS_KEY, self.replica_id)
            pipe.incr(seq_key(self.replica_id))
            seq = int(pipe.execute()[-1])
            client.publish(EVENTS_CHANNEL, gone_message(self.replica_id, seq))
        except Exception as exc:  # shutting down anyway
            log.debug("redis goodbye failed: %s", exc)
