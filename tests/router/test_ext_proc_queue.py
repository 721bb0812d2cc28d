"""The endpoint picker behind a real Envoy holds requests in the router's fair queue, as the HTTP
port does under --max-queue-wait (docs/gateway.md, "Queueing"): the fleet is one replica whose
heartbeat, written to a real Redis as the replicas write it, says its batch of one is full, as in
tests/router/test_router_tenants.py's queueing test; the replica is a real HTTP server on
loopback that records the prompts it is sent."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path
from tempfile import mkstemp
from typing import Any

import httpx
import pytest
import redis

from bench.envoy_gateway import envoy_config, listener
from kvscale.kv_index_schema import Heartbeat, heartbeat_args, heartbeat_keys, heartbeat_script
from kvscale.processes import free_port, wait_until
from kvscale.router.tenants import TenantFile
from tests.router.conftest import MODEL, RedisServer
from tests.router.test_ext_proc_envoy import picker_in_process, start_envoy
from tests.router.test_router_tenants import Replica

pytestmark = pytest.mark.slow

MAX_QUEUE_WAIT_S = 5.0


class RecordingReplica(Replica):
    """test_router_tenants' replica, serving the picker's model and recording each prompt; a body
    may come chunked (Envoy sends the one a FULL_DUPLEX_STREAMED picker streamed back so)."""

    prompts: list[str] = []

    def do_GET(self) -> None:
        self._answer(200, {"object": "list", "data": [{"id": MODEL}]})

    def do_POST(self) -> None:
        if "content-length" in self.headers:
            body = self.rfile.read(int(self.headers["content-length"]))
        else:
            body = b""
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            self.headers["content-length"] = str(len(body))
        self.prompts.append(json.loads(body)["prompt"])
        self.rfile = io.BytesIO(body)  # read again by the answer
        super().do_POST()


class Beats:
    """The replica's heartbeat, rewritten every 0.3 s (its TTL is 5 s) with ``running`` sequences
    in a batch of one."""

    def __init__(self, redis_url: str, replica: str) -> None:
        self.write = heartbeat_script(redis.Redis.from_url(redis_url))
        self.replica = replica
        self.id = f"picker-queue-{uuid.uuid4().hex[:6]}"
        self.running = 1
        self.stopped = threading.Event()
        self.beat()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def beat(self) -> None:
        hb = Heartbeat(self.id, MODEL, self.replica, 16, self.running, 0, 1, 100, time.time(), max_num_seqs=1)
        self.write(keys=heartbeat_keys(self.id), args=heartbeat_args(self.id, hb.to_json()))

    def set(self, running: int, router: Any) -> None:
        """Beat ``running`` now, and wait until ``router`` has read it from Redis."""
        self.running = running
        self.beat()

        def read() -> bool:
            hb = router.heartbeats.get(self.id)
            return hb is not None and hb.num_running == running

        wait_until(read, 10, interval=0.02, what=f"the picker read {running} running")

    def _loop(self) -> None:
        while not self.stopped.wait(0.3):
            self.beat()


def waits(router: Any, outcome: str) -> float:
    return router.metrics.registry.get_sample_value("kvscale_router_queue_waits_total", {"outcome": outcome}) or 0.0


@pytest.fixture(scope="module")
def held(session_redis: RedisServer) -> Iterator[tuple[Any, Beats, dict[str, str]]]:
    """The picker (with --max-queue-wait, its heartbeats from its own Redis database) over the
    replica, and an Envoy with a FULL_DUPLEX_STREAMED and a BUFFERED listener in front of it."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), RecordingReplica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    replica = f"http://127.0.0.1:{server.server_address[1]}"
    db = f"redis://127.0.0.1:{session_redis.port}/5"
    beats = Beats(db, replica)
    tenants = Path(mkstemp(prefix="picker-queue-tenants-", suffix=".yaml")[1])
    run = uuid.uuid4().hex[:6]
    tenants.write_text(f"- {{name: bulk-{run}, api_key: sk-bulk, priority: 5}}\n"
                       f"- {{name: urgent-{run}, api_key: sk-urgent, priority: 0}}\n")
    try:
        with picker_in_process([replica], policy="round-robin", redis_url=db, redis_timeout_ms=2000.0,
                               max_attempts=1, max_queue_wait_s=MAX_QUEUE_WAIT_S,
                               tenants=TenantFile(tenants)) as (router, grpc_port):
            wait_until(lambda: [r.replica_id for r in router.replicas.replicas.values()] == [beats.id], 20,
                       what="the picker bound to the replica's heartbeat")
            ports = {name: free_port() for name in ("streamed", "buffered", "admin")}
            log_path = mkstemp(prefix="envoy-queue-", suffix=".log")[1]
            envoy = start_envoy(envoy_config(ports["admin"], [
                listener("streamed", ports["streamed"], "picker", "FULL_DUPLEX_STREAMED", log_path),
                listener("buffered", ports["buffered"], "picker", "BUFFERED", log_path),
            ], {"picker": grpc_port}), ports["admin"])
            try:
                yield router, beats, {mode: f"http://127.0.0.1:{ports[mode]}/v1" for mode in ("streamed", "buffered")}
            finally:
                envoy.stop()
                Path(log_path).unlink(missing_ok=True)
    finally:
        beats.stopped.set()
        tenants.unlink()
        server.shutdown()
        server.server_close()


def complete(base_url: str, prompt: str, key: str = "sk-urgent", timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base_url}/completions", timeout=timeout, headers={"authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 1})


def test_requests_are_held_while_the_replica_is_full_and_sent_in_band_order_when_room_frees(held) -> None:
    router, beats, urls = held
    beats.set(1, router)
    released = waits(router, "released")
    with ThreadPoolExecutor(2) as pool:
        # The less urgent tenant's first: the more urgent tenant's overtakes it when a slot frees.
        later = pool.submit(complete, urls["streamed"], "later", "sk-bulk")
        wait_until(lambda: router.queue.waiting == 1, 10, interval=0.02, what="the first request held")
        sooner = pool.submit(complete, urls["buffered"], "sooner", "sk-urgent")
        wait_until(lambda: router.queue.waiting == 2, 10, interval=0.02, what="the second request held")
        time.sleep(0.6)  # heartbeats and queue ticks later, still full: still held
        assert not later.done() and not sooner.done() and not RecordingReplica.prompts
        beats.set(0, router)
        answers = [later.result(timeout=30), sooner.result(timeout=30)]
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    assert RecordingReplica.prompts[-2:] == ["sooner", "later"]
    assert waits(router, "released") == released + 2
    # Each was open on the replica until Envoy ended its stream, and is no longer.
    wait_until(lambda: not router.queue.unsent and not any(r.in_flight for r in router.replicas.replicas.values()),
               10, interval=0.02, what="the turns ended with their streams")


@pytest.mark.parametrize("mode", ["streamed", "buffered"])
def test_a_request_held_past_max_queue_wait_is_the_http_ports_503(held, mode: str) -> None:
    router, beats, urls = held
    beats.set(1, router)
    sent = len(RecordingReplica.prompts)
    started = time.monotonic()
    refused = complete(urls[mode], f"shed {mode}")
    assert time.monotonic() - started >= MAX_QUEUE_WAIT_S * 0.9
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1", refused.text
    assert refused.headers["content-type"] == "application/json"
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "overloaded")
    assert "--max-queue-wait" in error["message"]
    assert len(RecordingReplica.prompts) == sent and router.queue.waiting == 0


def test_a_client_that_leaves_while_held_leaves_nothing_in_the_queue(held) -> None:
    router, beats, urls = held
    beats.set(1, router)
    disconnected, timed_out = waits(router, "disconnected"), waits(router, "timeout")
    with pytest.raises(httpx.ReadTimeout):
        complete(urls["streamed"], "gone", timeout=1.0)
    # Envoy resets the picker's stream as its client goes: the wait ends then, not at its limit.
    wait_until(lambda: router.queue.waiting == 0, MAX_QUEUE_WAIT_S / 2, interval=0.02, what="the held request gone")
    assert waits(router, "disconnected") == disconnected + 1 and waits(router, "timeout") == timed_out
    assert not router.queue.queues and not router.queue.opened and not router.queue.unsent
    assert router.metrics.registry.get_sample_value("kvscale_router_queued_requests") == 0
    beats.set(0, router)
    assert complete(urls["streamed"], "after").status_code == 200
