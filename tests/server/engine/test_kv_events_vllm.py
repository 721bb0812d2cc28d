"""KV events in vLLM's wire format (--kv-events-config): an engine's steps through the core's loop
turn (core_loop.step_and_publish) reach a ZMQ SUB socket as [topic, seq, msgpack EventBatch],
decoded with structs written here from vLLM's layout; their hashes, parents and tokens are the
engine's; eviction and a reset show; replay serves from a sequence number; a full queue drops
without blocking; bad configs are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import msgspec
import pytest
import zmq

from kvscale.block_hash import hash_prompt_blocks
from kvscale.processes import free_port
from kvscale.server.core.block_pool import BlockPool
from kvscale.server.core.host_tier import HostTier
from kvscale.server.engine.core_loop import step_and_publish
from kvscale.server.engine.kv_events_config import KVEventsConfig, parse_kv_events_config
from kvscale.server.engine.kv_events_vllm import (
    KVEventSinks,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmKVEventPublisher,
    to_vllm_events,
)
from kvscale.server.entrypoints.metrics import ServerMetrics
from kvscale.server.outputs import BlockStored, EngineStats
from kvscale.server.sampling_params import SamplingParams

BS = 16


# vLLM's format (vllm/distributed/kv_events.py), written out here independently of the server's.
class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


class Stored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class Removed(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class Cleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


DECODER = msgspec.msgpack.Decoder(Batch)


def tokens(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 40000 + 100 for i in range(n)]


def run(engine: Any, publisher: VllmKVEventPublisher, prompt: list[int]) -> None:
    engine.add_request(f"r{prompt[0]}-{len(prompt)}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        step_and_publish(engine, publisher, had_input=True, last_publish=0.0)


def receive(sub: Any, count: int) -> list[tuple[int, Batch, bytes]]:
    out: list[tuple[int, Batch, bytes]] = []
    while len(out) < count:
        assert sub.poll(5000), f"only {len(out)} of {count} batches arrived"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kvscale"
        assert len(seq) == 8
        out.append((int.from_bytes(seq, "big"), DECODER.decode(payload), payload))
    return out


def test_an_engines_blocks_reach_a_subscriber_in_vllms_format(make_engine: Any) -> None:
    engine = make_engine(num_gpu_blocks_override=8, block_size=BS)
    port, replay_port = free_port(), free_port()
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", "topic": "kvscale",'
        f' "replay_endpoint": "tcp://*:{replay_port}", "buffer_steps": 8}}')
    publisher = VllmKVEventPublisher(config)
    publisher.start()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvscale")
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)  # PUB drops what it sends before the subscription arrives
        a = tokens(1, 40)
        run(engine, publisher, a)  # 2 full blocks (the third is partial)
        [(seq, batch, payload)] = receive(sub, 1)
        assert seq == 0 and batch.data_parallel_rank == 0 and batch.ts > 0
        [stored] = batch.events
        hashes = hash_prompt_blocks(a, BS)
        assert stored == Stored(block_hashes=hashes, parent_block_hash=None, token_ids=a[:32],
                                block_size=BS, lora_id=None, medium="GPU")
        # Literally vLLM's layout: arrays, the event tagged by its class name, then lora_name.
        assert msgspec.msgpack.decode(payload)[1] == [["BlockStored", hashes, None, a[:32], BS, None, "GPU", None]]

        # a continues: its third block's parent is its second.
        b = a + tokens(9, 20)
        run(engine, publisher, b)
        [(seq, batch, _)] = receive(sub, 1)
        assert seq == 1
        assert batch.events == [Stored(block_hashes=hash_prompt_blocks(b, BS)[2:], parent_block_hash=hashes[1],
                                       token_ids=b[32:48], block_size=BS, lora_id=None, medium="GPU")]

        # A prompt of 7 blocks on an 8-block pool evicts a's cached blocks: removed, then stored.
        c = tokens(500, 7 * BS + 1)
        run(engine, publisher, c)
        events = [e for _, batch, _ in receive(sub, 1) for e in batch.events]
        removed = {h for e in events if isinstance(e, Removed) for h in e.block_hashes}
        assert set(hash_prompt_blocks(b, BS)) <= removed
        assert all(e.medium == "GPU" for e in events if isinstance(e, Removed))
        stored_c = [h for e in events if isinstance(e, Stored) for h in e.block_hashes]
        assert stored_c == hash_prompt_blocks(c, BS)

        assert engine.reset_prefix_cache()
        step_and_publish(engine, publisher, had_input=True, last_publish=0.0)
        [(seq, batch, _)] = receive(sub, 1)
        assert seq == 3 and batch.events == [Cleared()]

        # Replay from sequence 2: batches 2 and 3, then the end marker (-1, empty).
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            _, seq_bytes, body = dealer.recv_multipart()
            if int.from_bytes(seq_bytes, "big", signed=True) == -1:
                assert body == b""
                break
            replies.append((int.from_bytes(seq_bytes, "big"), DECODER.decode(body).events))
        assert [s for s, _ in replies] == [2, 3] and replies[1][1] == [Cleared()]
        dealer.close(0)
        assert publisher.batches_published == 4 and publisher.batches_dropped == 0
    finally:
        sub.close(0)
        context.term()
        publisher.stop()


def test_a_full_queue_drops_batches_without_blocking_and_leaves_a_gap() -> None:
    publisher = VllmKVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", max_queue_size=1))
    event = BlockStored([1], None, BS, token_ids=tuple(range(BS)))
    started = time.perf_counter()
    for _ in range(2):
        publisher.on_step([event])  # not started: nothing drains the queue
    publisher.on_step([event, event])
    stats = EngineStats(0, 0, 8, 0, 0, BS, 0, 0, 0)
    publisher.on_step([], stats=stats)  # a step without events sends nothing, but its stats carry the counts
    assert time.perf_counter() - started < 0.5
    assert (publisher.batches_dropped, publisher.events_dropped) == (2, 3)
    assert publisher._next_seq == 3  # the dropped batches' numbers are spent: subscribers see a gap
    # The counts reach the front end's /metrics from the step's stats.
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'kvscale:kv_events_batches_dropped_total{model_name="m"} 2.0' in text
    assert 'kvscale:kv_events_dropped_total{model_name="m"} 3.0' in text


def test_configs_spelled_as_vllms() -> None:
    assert not parse_kv_events_config("{}").publishes
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert on.publishes and on.publisher == "zmq" and on.endpoint == "tcp://*:5557"
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    for bad, why in [
        ("[]", "expected a JSON object"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be one of null, zmq"),
        ('{"endpoint": "http://x:1"}', "endpoint must start with"),
        ('{"endpoint": "tcp://*"}', "needs a port"),
        ('{"buffer_steps": 0}', "buffer_steps must be at least 1"),
        ('{"hwm": true}', "hwm must be an integer, got true"),
        ('{"max_queue_size": "10"}', "max_queue_size must be an integer"),
        ('{"enable_kv_cache_event": true}', "unknown field(s) enable_kv_cache_event"),
        ('{"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}', "must differ"),
    ]:
        with pytest.raises(ValueError) as info:
            parse_kv_events_config(bad)
        assert why in str(info.value), (bad, str(info.value))


def test_serve_refuses_a_bad_config_with_exit_code_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvscale", "serve", "--kv-events-config",
         '{"enable_kv_cache_events": true, "publisher": "kafka"}'],
        capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--kv-events-config: publisher must be one of null, zmq, got 'kafka'" in result.stderr


def test_the_host_tier_is_medium_cpu_and_its_blocks_keep_their_tokens() -> None:
    pool = BlockPool(4, BS, host=HostTier(4))
    prompt = tokens(3, 2 * BS)
    h0, h1 = hash_prompt_blocks(prompt, BS, lora_name="ad")
    b0, b1 = pool.allocate(), pool.allocate()
    pool.register_full_block(b0, h0, None, tuple(prompt[:BS]), "ad")
    pool.register_full_block(b1, h1, h0, tuple(prompt[BS:]), "ad")
    stored = to_vllm_events(pool.drain_events())
    assert stored == [VllmBlockStored([h0, h1], None, prompt, BS, None, "GPU", "ad")]  # one chain, one event
    pool.free([b0, b1])
    pool.demote_blocks([b0, b1])  # down to the host tier
    assert to_vllm_events(pool.drain_events()) == [
        VllmBlockRemoved([h0], "GPU"), VllmBlockStored([h0], None, prompt[:BS], BS, None, "CPU", "ad"),
        VllmBlockRemoved([h1], "GPU"), VllmBlockStored([h1], h0, prompt[BS:], BS, None, "CPU", "ad")]
    pool.take_tier_copies()
    [entry] = pool.reserve_host([h0])
    block = pool.promote(h0, entry)  # and back up, its tokens with it
    assert to_vllm_events(pool.drain_events()) == [
        VllmBlockRemoved([h0], "CPU"), VllmBlockStored([h0], None, prompt[:BS], BS, None, "GPU", "ad")]
    pool.free([block])
    pool.take_tier_copies()


def test_every_sink_gets_each_steps_events() -> None:
    class Sink:
        def __init__(self) -> None:
            self.seen: list[list] = []
            self.stopped = False

        def on_step(self, events: list, stats: Any, snapshot: Any) -> None:
            self.seen.append(events)

        def stop(self) -> None:
            self.stopped = True

    redis_side, vllm_side = Sink(), Sink()
    sinks = KVEventSinks([redis_side, vllm_side])
    event = BlockStored([1], None, BS)
    sinks.on_step([event], stats=None, snapshot=list)  # type: ignore[arg-type]
    sinks.stop()
    assert redis_side.seen == vllm_side.seen == [[event]] and redis_side.stopped and vllm_side.stopped
