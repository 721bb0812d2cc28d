"""The replica's KV events in vLLM's wire format, on a ZMQ PUB socket, for llm-d and Dynamo.

The events are the block pool's, the ones the Redis publisher (kv_publisher.py) gets: the core's
loop hands each step's list to every sink (``KVEventSinks``). This sink turns a non-empty list
into one ``EventBatch`` and puts it on a bounded queue, never blocking the engine thread: a full
queue drops the batch and counts it, and its sequence number is spent, so a subscriber sees the
gap. A background thread encodes and sends each batch as the three frames vLLM's publisher
sends, [topic, sequence number (8 bytes, big-endian), msgpack payload], and keeps the last
``buffer_steps`` of them for the replay socket. docs/engine.md "KV events for llm-d and Dynamo".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from kvscale.kv_index_schema import TIER_DEVICE
from kvscale.server.engine.kv_events_config import KVEventsConfig
from kvscale.server.outputs import AllBlocksCleared, BlockRemoved, BlockStored, EngineStats, KVEvent

log = logging.getLogger("kvscale.kv_events_vllm")

# vLLM names the tier a block is in; consumers map "GPU" to the device tier, "CPU" to the host's.
MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# The keys of EngineStats.extra the drop counters travel under to the front end's /metrics
# (server/entrypoints/metrics.py); absent (no --kv-events-config) reads as 0.
STAT_BATCHES_DROPPED = "kv_events_batches_dropped_total"
STAT_EVENTS_DROPPED = "kv_events_events_dropped_total"


# vLLM's structs (vllm/distributed/kv_events.py), field for field in its order: array-like, so a
# struct is a msgpack array of its fields; tagged, so an event's first element is its class name.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    # Newer vLLM's field after medium (consumers of the older layout ignore a trailing element).
    lora_name: str | None = None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


def _medium(tier: int) -> str:
    return MEDIUM_DEVICE if tier == TIER_DEVICE else MEDIUM_HOST


def to_vllm_events(events: Sequence[KVEvent]) -> list[KVCacheEvent]:
    """The pool's events (one block each) as vLLM's, in order. A run of stores that continue one
    chain (each block's parent the previous one) in one tier and adapter becomes one BlockStored,
    its tokens concatenated, as vLLM stores a request's new blocks; a run of removals in one tier
    becomes one BlockRemoved."""
    out: list[KVCacheEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, BlockStored):
            medium = _medium(event.tier)
            if (isinstance(last, VllmBlockStored) and last.medium == medium and last.lora_name == event.lora_name
                    and last.block_size == event.block_size and event.parent_block_hash == last.block_hashes[-1]):
                last.block_hashes.extend(int(h) for h in event.block_hashes)
                last.token_ids.extend(event.token_ids)
                continue
            out.append(VllmBlockStored(
                block_hashes=[int(h) for h in event.block_hashes],
                parent_block_hash=None if event.parent_block_hash is None else int(event.parent_block_hash),
                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
                medium=medium, lora_name=event.lora_name))
        elif isinstance(event, BlockRemoved):
            medium = _medium(event.tier)
            if isinstance(last, VllmBlockRemoved) and last.medium == medium:
                last.block_hashes.extend(int(h) for h in event.block_hashes)
                continue
            out.append(VllmBlockRemoved(block_hashes=[int(h) for h in event.block_hashes], medium=medium))
        elif isinstance(event, AllBlocksCleared):
            out.append(VllmAllBlocksCleared())
    return out


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc:// or inproc:// is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_STOP = None


class VllmKVEventPublisher:
    """One PUB socket (and an optional ROUTER for replay) fed from the engine thread's steps."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[tuple[int, EventBatch] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0  # engine thread only
        self._thread: threading.Thread | None = None
        self._context: Any = None
        self._pub: Any = None
        self._replay: Any = None
        # Counters: batches sent and dropped on a full queue, and their events (the drops reach
        # /metrics through each step's stats, ``on_step``).
        self.batches_published = 0
        self.batches_dropped = 0
        self.events_dropped = 0

    # -- lifecycle (engine thread) --------------------------------------------------------------
    def start(self) -> None:
        """Bind or connect now, so a taken port fails the replica's start; then the thread runs."""
        import zmq

        config = self.config
        self._context = zmq.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            self._pub.setsockopt(zmq.LINGER, 500)
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close()
            # A flag's value the machine refuses: "invalid", so `kvscale serve` exits 2.
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {exc}") from exc
        # The sockets move to the thread here (thread start is the memory barrier ZMQ asks for).
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        self._thread.start()
        log.info("KV events in vLLM's format on %s%s", config.endpoint,
                 f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._thread is None:
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._pub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    # -- engine thread ----------------------------------------------------------------------------
    def on_step(self, events: list[KVEvent], stats: EngineStats | None = None,
                snapshot: Callable[[], list[int]] | None = None) -> None:
        """Never blocks: one batch per step that has events, or a dropped one, counted. The step's
        ``stats`` carry the drop counts on every step, with events or not: /metrics reads the
        newest stats, and a counter missing from them would read as a reset to 0."""
        if events:
            self._enqueue(events)
        if stats is not None:
            stats.extra[STAT_BATCHES_DROPPED] = float(self.batches_dropped)
            stats.extra[STAT_EVENTS_DROPPED] = float(self.events_dropped)

    def _enqueue(self, events: list[KVEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        batch = EventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            if not self.batches_dropped:
                log.warning("KV event queue full (max_queue_size %d): dropping batches; subscribers "
                            "see the gap in sequence numbers", self.config.max_queue_size)
            self.batches_dropped += 1
            self.events_dropped += len(events)

    # -- background thread ------------------------------------------------------------------------
    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05 if self._replay is not None else 1.0)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            seq, batch = item
            # Converted here, off the engine thread: the pool's events are never touched again.
            batch.events = to_vllm_events(batch.events)
            payload = encoder.encode(batch)
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - a send failure must not end the replica's events
                log.exception("sending KV event batch %d failed", seq)
                continue
            self._buffer.append((seq, payload))
            self.batches_published += 1

    def _serve_replay(self) -> None:
        """A request [identity, "", start sequence (8 bytes, big-endian)] gets every buffered batch
        from there as [identity, "", seq, payload], then [identity, "", -1, ""] (vLLM's replay)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a replay request of %d frames (expected 3)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


class KVEventSinks:
    """Every sink of the block pool's events, as the core's loop sees one publisher: the Redis
    publisher (which also wants the stats and the snapshot) and the vLLM-format one."""

    def __init__(self, sinks: Sequence[Any]) -> None:
        self.sinks = list(sinks)

    def on_step(self, events: list[KVEvent], stats: EngineStats,
                snapshot: Callable[[], list[int]]) -> None:
        for sink in self.sinks:
            sink.on_step(events=events, stats=stats, snapshot=snapshot)

    def stop(self) -> None:
        for sink in self.sinks:
            sink.stop()
