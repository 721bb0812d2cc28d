"""Forwarding down a ranking against real HTTP servers on loopback (one per behaviour, and ports
nobody listens on): what moves on to the next replica, what the client gets, and that every
attempt's accounting is closed."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from reset_transport import ResetAsMade
from starlette.responses import Response, StreamingResponse

from kvscale.drain import DRAINING_HEADER
from kvscale.processes import free_port
from kvscale.router.decision import SessionMemory
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.proxy import Forwarder, Routed, replica_headers
from kvscale.router.replicas import Replica, ReplicaSet

BEHAVIOUR = {
    "ok": (200, {"x-upstream": "yes"}),
    "broken": (500, {}),
    "draining": (503, {DRAINING_HEADER: "1"}),
    "late": (504, {}),  # its --request-timeout passed
}


def serve(status: int, headers: dict[str, str]) -> ThreadingHTTPServer:
    class Replica(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = json.dumps({"status": status}).encode()
            self.send_response(status)
            for name, value in {**headers, "content-type": "application/json"}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Replica)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    servers = {name: serve(*behaviour) for name, behaviour in BEHAVIOUR.items()}
    found = {name: f"http://127.0.0.1:{server.server_address[1]}" for name, server in servers.items()}
    # Ports handed out once and never bound: connecting is refused.
    found |= {name: f"http://127.0.0.1:{free_port()}" for name in ("refused", "gone")}
    yield found
    for server in servers.values():
        server.shutdown()
        server.server_close()


def forwarder() -> tuple[Forwarder, RouterMetrics, SessionMemory]:
    metrics = RouterMetrics()
    sessions = SessionMemory()
    forward = Forwarder(1.0, "prefix-affinity", ReplicaSet(), PrefixIndex(),
                        InFlight(metrics.in_flight), sessions, metrics)
    return forward, metrics, sessions


def routed(urls: dict[str, str], *names: str) -> Routed:
    ranked = [Replica(urls[name], name, healthy=True) for name in names]
    return Routed(endpoint="completions", body=b"{}", headers={"content-type": "application/json"},
                  ranked=ranked, hashes=[1, 2], prompt_tokens=40, predicted_hit_tokens=16,
                  session="session-1", router_ms=0.25)


def send(forward: Forwarder, request: Routed) -> tuple[Response, bytes]:
    async def go() -> tuple[Response, bytes]:
        forward.open()  # the client's connections belong to this event loop
        try:
            response = await forward.forward(request)
            body = b""
            if isinstance(response, StreamingResponse):
                async for chunk in response.body_iterator:
                    body += chunk if isinstance(chunk, bytes) else str(chunk).encode()
            else:
                body = bytes(response.body)
            return response, body
        finally:
            await forward.close()

    return asyncio.run(go())


def test_failures_before_the_first_byte_move_on_and_every_attempt_is_closed(urls) -> None:
    forward, metrics, sessions = forwarder()
    request = routed(urls, "refused", "broken", "draining", "ok")
    response, body = send(forward, request)
    assert response.status_code == 200 and json.loads(body) == {"status": 200}
    assert response.headers["x-kvscale-replica"] == "ok" and response.headers["x-upstream"] == "yes"
    assert response.headers["x-kvscale-router-ms"] == "0.250"
    assert response.headers["x-kvscale-predicted-hit-tokens"] == "16"
    reasons = ("connection", "status_5xx", "draining")
    assert [metrics.retries.labels(r)._value.get() for r in reasons] == [1, 1, 1]
    refused, broken, draining, ok = request.ranked
    assert not refused.healthy and broken.healthy and not draining.healthy and ok.healthy
    assert "draining" in draining.status
    assert all(r.in_flight == 0 for r in request.ranked)
    assert sessions.get("session-1") == "ok"
    # Only the first choice is charged the predicted hit; every one tried is predicted to hold it.
    assert forward.index.match([1, 2], ["refused", "ok"], 0.0) == {"refused": 2, "ok": 2}


def test_the_last_replicas_error_is_the_clients_and_nothing_answering_is_a_502(urls) -> None:
    forward, metrics, _ = forwarder()
    response, body = send(forward, routed(urls, "refused", "broken"))
    assert response.status_code == 500 and json.loads(body) == {"status": 500}
    response, body = send(forward, routed(urls, "refused", "gone"))
    assert response.status_code == 502
    error = json.loads(body)["error"]
    assert error["type"] == "bad_gateway" and "replica gone" in error["message"]
    assert metrics.requests.labels("none", "prefix-affinity", "502")._value.get() == 1


def test_the_replica_gets_the_routers_key_and_the_passed_through_headers_only() -> None:
    client = {"accept": "text/event-stream", "x-request-id": "r-1",
              "authorization": "Bearer client", "cookie": "c"}
    assert replica_headers(client, "replica-key") == {
        "content-type": "application/json", "accept": "text/event-stream", "x-request-id": "r-1",
        "authorization": "Bearer replica-key"}
    assert "authorization" not in replica_headers(client, None)


def test_a_replicas_request_timeout_is_the_clients_not_retried_elsewhere(urls) -> None:
    """A 504 says the replica spent its --request-timeout on the request: the next replica would
    spend it again, so the client gets it."""
    forward, metrics, _ = forwarder()
    request = routed(urls, "late", "ok")
    response, body = send(forward, request)
    assert response.status_code == 504 and json.loads(body) == {"status": 504}
    assert metrics.retries.labels("status_5xx")._value.get() == 0
    assert all(r.in_flight == 0 for r in request.ranked)


def test_a_connection_reset_as_it_is_made_moves_on_like_a_refused_one(urls) -> None:
    forward, metrics, _ = forwarder()
    request = routed(urls, "gone", "ok")

    async def go() -> Response:
        forward.open()
        await forward.close()
        forward._client = httpx.AsyncClient(transport=ResetAsMade(urls["gone"]))
        try:
            return await forward.forward(request)
        finally:
            await forward.close()

    response = asyncio.run(go())
    assert response.status_code == 200 and response.headers["x-kvscale-replica"] == "ok"
    assert metrics.retries.labels("connection")._value.get() == 1
    reset, ok = request.ranked
    assert not reset.healthy and ok.healthy and reset.in_flight == 0
