"""Tenants through the router (docs/router.md, "Tenants"): two routers' apps, with the gate and
limits of `kvscale router`, served by uvicorn in this process and sharing a real redis-server;
the replica is a real HTTP server on loopback that answers with a usage and says which tenant
header it received."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import redis

from kvscale.fair_share_schema import counter_key
from kvscale.kv_index_schema import Heartbeat, heartbeat_args, heartbeat_keys, heartbeat_script
from kvscale.processes import free_port
from kvscale.router.config import RouterConfig
from kvscale.router.tenants import TenantFile
from kvscale.tenant_limits_schema import TENANT_HEADER, WINDOW_S, window_key

MODEL = "fake"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
         "prompt_tokens_details": {"cached_tokens": 0}}


class Replica(BaseHTTPRequestHandler):
    """A replica that answers every generation with USAGE and the tenant header it received
    (``seen-tenant``); a prompt of "fail" is answered 400 without usage."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(200, {"object": "list", "data": [{"id": MODEL}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body.get("prompt") == "fail":
            self._answer(400, {"error": {"message": "bad", "type": "BadRequestError"}})
            return
        if body.get("stream"):  # the usage in a chunk of its own, as include_usage asks
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for event in ({"choices": [{"index": 0, "text": "x"}], "usage": None},
                          {"choices": [], "usage": USAGE}):
                self._chunk(f"data: {json.dumps(event)}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            return
        self._answer(200, {"id": "c", "object": "text_completion", "model": MODEL,
                           "choices": [{"index": 0, "text": "x"}], "usage": USAGE})

    def _chunk(self, part: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.flush()

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("seen-tenant", self.headers.get(TENANT_HEADER, "-"))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def run() -> str:
    """Names this run's tenants apart from any other run's in the session's Redis."""
    return uuid.uuid4().hex[:6]


def tenants_yaml(run: str) -> str:
    return f"""
- {{name: limited-{run}, api_key: sk-limited, requests_per_minute: 3}}
- {{name: tokens-{run}, api_key: sk-tokens, tokens_per_minute: 200}}
- {{name: stream-{run}, api_key: sk-stream, tokens_per_minute: 1000}}
- {{name: free-{run}, api_key_sha256: {hashlib.sha256(b"sk-free").hexdigest()}}}
"""


def start(in_process_routers, replica: str, tenants: TenantFile, redis_url: str | None) -> str:
    # The limits fail open past --redis-timeout-ms (50 ms by default); these routers and Redis
    # share a busy machine with the rest of the suite, so they wait longer before letting a
    # request in unchecked, which the tests below would read as a missing limit.
    url = in_process_routers.start(RouterConfig(
        replicas=[replica], policy="round-robin", models=[], health_interval_s=0.2,
        max_attempts=1, redis_url=redis_url, tenants=tenants, redis_timeout_ms=2000.0))
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the replica never became healthy behind the router"
        time.sleep(0.05)
    return url


@pytest.fixture(scope="module")
def routers(in_process_routers, replica, session_redis, run, tmp_path_factory) -> list[str]:
    """Two routers of one fleet: the same tenants file, the same Redis."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(tenants_yaml(run))
    return [start(in_process_routers, replica, TenantFile(path), session_redis.url)
            for _ in range(2)]


def post(url: str, key: str | None, **body: object) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=10,
                      json={"model": MODEL, "prompt": "hello", **body})


def clear_of_window_end(redis_url: str, margin_s: float = 10.0) -> None:
    """A test counting requests in one window waits out its end when it is near: near enough that
    its requests, each seconds long on a loaded machine, might see it roll over."""
    seconds, micros = redis.Redis.from_url(redis_url).time()
    left = WINDOW_S - (seconds + micros / 1e6) % WINDOW_S
    if left < margin_s:
        time.sleep(left + 0.05)


def metric(url: str, sample: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not in /metrics")


def test_the_n_plus_first_request_across_two_routers_is_429(routers, run, session_redis) -> None:
    clear_of_window_end(session_redis.url)
    answers = [post(routers[i % 2], "sk-limited", max_tokens=1) for i in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0", "0"]
    assert {a.headers["x-ratelimit-limit-requests"] for a in answers} == {"3"}
    assert "x-ratelimit-limit-tokens" not in answers[0].headers  # no tokens limit: no header
    refused = answers[-1]
    assert 1 <= int(refused.headers["retry-after"]) <= WINDOW_S
    assert set(refused.json()) == {"error"}  # OpenAI's error object
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "requests"
    assert "limit 3, used 3" in refused.json()["error"]["message"]
    tenant = f'tenant="limited-{run}"'
    assert metric(routers[1], f"kvscale_router_tenant_requests_total{{{tenant}}}") == 2
    limited = f'kvscale_router_tenant_rate_limited_total{{limit="requests",{tenant}}}'
    assert metric(routers[1], limited) == 1 and metric(routers[0], limited) == 0


def test_an_unknown_or_missing_key_is_401_from_the_head(routers) -> None:
    for key in (None, "sk-nobody", "sk-limited2"):
        answer = post(routers[0], key)
        assert answer.status_code == 401, key
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{routers[0]}/v1/models").status_code == 401
    assert httpx.get(f"{routers[0]}/v1/models",
                     headers={"authorization": "Bearer sk-free"}).status_code == 200
    port = int(routers[0].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        # 30 MiB announced, none sent: answered from the head, no body read.
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nauthorization: Bearer sk-x\r\n"
                     b"content-length: 31457280\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 401")


def test_the_replica_gets_the_tenant_from_the_router_only(routers, run) -> None:
    answer = httpx.post(f"{routers[0]}/v1/completions", timeout=10,
                        headers={"authorization": "Bearer sk-free", TENANT_HEADER: "limited-x"},
                        json={"model": MODEL, "prompt": "hello"})
    assert answer.status_code == 200 and answer.headers["seen-tenant"] == f"free-{run}"
    assert "x-ratelimit-limit-requests" not in answer.headers  # a tenant without limits
    tokenize = httpx.post(f"{routers[0]}/tokenize", timeout=10, json={"prompt": "x"},
                          headers={"authorization": "Bearer sk-free", TENANT_HEADER: "evil"})
    assert tokenize.headers["seen-tenant"] == f"free-{run}"


def test_tokens_are_reserved_then_settled_with_the_usage(routers, run, session_redis) -> None:
    client = redis.Redis.from_url(session_redis.url)
    clear_of_window_end(session_redis.url)
    first = post(routers[0], "sk-tokens", max_tokens=150)  # prompt ~12 (bytes / 4) + 150
    assert first.status_code == 200
    reserved = 200 - int(first.headers["x-ratelimit-remaining-tokens"])
    assert 150 < reserved < 200 and first.headers["x-ratelimit-limit-tokens"] == "200"
    window = int(client.time()[0]) // WINDOW_S
    key = window_key(f"tokens-{run}", window, "tokens")
    deadline = time.monotonic() + 5
    while client.get(key) != b"10":  # the usage reported (7 + 3) replaces the reservation
        assert time.monotonic() < deadline, client.get(key)
        time.sleep(0.02)
    # What the reservation gave back lets another large request in; one the replica refuses
    # gives all of its reservation back.
    def settled_at(tokens: bytes) -> None:
        deadline = time.monotonic() + 5
        while client.get(key) != tokens:
            assert time.monotonic() < deadline, client.get(key)
            time.sleep(0.02)

    assert post(routers[1], "sk-tokens", max_tokens=150).status_code == 200
    settled_at(b"20")
    assert post(routers[1], "sk-tokens", max_tokens=150, prompt="fail").status_code == 400
    settled_at(b"20")
    over = post(routers[0], "sk-tokens", max_tokens=180)
    assert over.status_code == 429 and over.json()["error"]["type"] == "tokens"
    assert "retry-after" in over.headers and over.headers["x-ratelimit-remaining-tokens"] == "180"
    alone = post(routers[0], "sk-tokens", max_tokens=500)
    assert alone.status_code == 429 and "Request too large" in alone.json()["error"]["message"]
    assert "retry-after" not in alone.headers  # waiting would not help


def test_a_streams_reservation_is_settled_with_its_usage_chunk(routers, run,
                                                              session_redis) -> None:
    client = redis.Redis.from_url(session_redis.url)
    clear_of_window_end(session_redis.url)
    answer = post(routers[1], "sk-stream", max_tokens=100, stream=True,
                  stream_options={"include_usage": True})
    assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    assert 100 < 1000 - int(answer.headers["x-ratelimit-remaining-tokens"]) < 200
    key = window_key(f"stream-{run}", int(client.time()[0]) // WINDOW_S, "tokens")
    deadline = time.monotonic() + 5
    while client.get(key) != b"10":  # the usage chunk (7 + 3) replaces the reservation
        assert time.monotonic() < deadline, client.get(key)
        time.sleep(0.02)


def test_limits_fail_open_when_redis_does_not_answer(in_process_routers, replica, run,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(tenants_yaml(run))
    url = start(in_process_routers, replica, TenantFile(path), f"redis://127.0.0.1:{free_port()}/0")
    answers = [post(url, "sk-limited") for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert "x-ratelimit-remaining-requests" not in answers[0].headers
    assert metric(url, "kvscale_router_tenant_limits_unchecked_total") == 4


def test_a_changed_tenants_file_is_used_and_a_broken_one_ignored(in_process_routers, replica,
                                                                 run, tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"- {{name: old-{run}, api_key: sk-old}}\n")
    url = start(in_process_routers, replica, TenantFile(path, poll_s=0.05), None)
    assert post(url, "sk-old").status_code == 200 and post(url, "sk-new").status_code == 401
    assert metric(url, f'kvscale_router_tenant_requests_total{{tenant="old-{run}"}}') == 1
    new = path.with_suffix(".new")
    new.write_text(f"- {{name: new-{run}, api_key: sk-new}}\n")
    new.replace(path)
    time.sleep(0.1)
    answer = post(url, "sk-new")
    assert answer.status_code == 200 and answer.headers["seen-tenant"] == f"new-{run}"
    assert post(url, "sk-old").status_code == 401
    # The series follow the file: the tenant it no longer lists leaves /metrics.
    assert f'tenant="old-{run}"' not in httpx.get(f"{url}/metrics").text
    path.write_text("- {name: broken}\n")
    time.sleep(0.1)
    assert post(url, "sk-new").status_code == 200


def bound(url: str, replica_id: str) -> bool:
    """The router routes to the replica under the id its heartbeat gives."""
    replicas = httpx.get(f"{url}/health").json()["replicas"]
    return bool(replicas) and replicas[0]["id"] == replica_id and replicas[0]["healthy"]


def test_two_routers_queue_on_real_heartbeats_and_count_limits_before_the_queue(
        in_process_routers, replica, session_redis, run, tmp_path: Path) -> None:
    """--max-queue-wait with the room read from the replica's heartbeat in Redis, written as the
    replicas write it (kvscale.kv_index_schema), in a Redis database of its own so that the
    session's real replicas' routers never see this one: both routers hold while the heartbeat
    says the batch is full and release when it says a slot is free; a tenant's limit is counted
    across both before any request waits, so the one over it is 429 at once."""
    db = f"redis://127.0.0.1:{session_redis.port}/3"
    client = redis.Redis.from_url(db)
    write = heartbeat_script(client)
    rid = f"queue-{run}"

    def beat(running: int) -> None:
        hb = Heartbeat(rid, MODEL, replica, 16, running, 0, 1, 100, time.time(), max_num_seqs=1)
        write(keys=heartbeat_keys(rid), args=heartbeat_args(rid, hb.to_json()))

    path = tmp_path / "tenants.yaml"
    path.write_text(f"- {{name: queued-{run}, api_key: sk-queued, requests_per_minute: 3}}\n")
    beat(1)  # one sequence running in a batch of one: full
    config = RouterConfig(replicas=[replica], policy="round-robin", models=[], max_attempts=1,
                          health_interval_s=0.2, redis_url=db, tenants=TenantFile(path),
                          redis_timeout_ms=2000.0, max_queue_wait_s=8.0)
    with ThreadPoolExecutor(2) as pool:  # each start takes a second or so: both at once
        urls = list(pool.map(in_process_routers.start, [config, config]))
    deadline = time.monotonic() + 20
    while not all(bound(u, rid) for u in urls):
        assert time.monotonic() < deadline, "the routers never read the replica's heartbeat"
        time.sleep(0.05)
    clear_of_window_end(db)
    beat(1)
    with ThreadPoolExecutor(3) as pool:
        waiting = [pool.submit(post, url, "sk-queued", max_tokens=1)
                   for url in (urls[0], urls[1], urls[0])]
        deadline = time.monotonic() + 5
        while [httpx.get(f"{u}/health").json()["queued"] for u in urls] != [2, 1]:
            assert time.monotonic() < deadline, "the requests were not held"
            time.sleep(0.02)
        over = post(urls[1], "sk-queued", max_tokens=1)  # the 4th of 3 a minute, over 2 routers
        assert over.status_code == 429 and "retry-after" in over.headers
        assert over.json()["error"]["code"] == "rate_limit_exceeded"
        beat(1)  # within the heartbeat's TTL however slow the steps above were
        time.sleep(0.6)  # a heartbeat poll and a queue tick later, still full: still held
        assert not any(w.done() for w in waiting)
        beat(0)  # the slot is free
        answers = [w.result(timeout=10) for w in waiting]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert sorted(a.headers["x-ratelimit-remaining-requests"] for a in answers) == ["0", "1", "2"]
    waited = f'kvscale_router_tenant_queue_wait_seconds_total{{tenant="queued-{run}"}}'
    assert all(metric(u, waited) >= 0.6 for u in urls)
    assert metric(urls[0], 'kvscale_router_queue_waits_total{outcome="released"}') == 2
    # Both routers charged the tenant's one shared counter: 3 answers of 10 tokens (USAGE).
    assert all(metric(u, "kvscale_router_fair_share_shared") == 1 for u in urls)
    deadline = time.monotonic() + 5
    while client.get(counter_key(f"queued-{run}")) != b"30":
        assert time.monotonic() < deadline, client.get(counter_key(f"queued-{run}"))
        time.sleep(0.02)
