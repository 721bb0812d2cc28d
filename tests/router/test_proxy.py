"""Forwarding down a ranking against in-memory replicas (httpx's MockTransport): what moves on
to the next replica, what the client gets, and that every attempt's accounting is closed."""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.responses import Response, StreamingResponse

from kvscale.drain import DRAINING_HEADER
from kvscale.router.decision import SessionMemory
from kvscale.router.in_flight import InFlight
from kvscale.router.index import PrefixIndex
from kvscale.router.metrics import RouterMetrics
from kvscale.router.proxy import Forwarder, Routed, replica_headers
from kvscale.router.replicas import Replica, ReplicaSet


def answer(status: int, headers: dict[str, str] | None = None) -> httpx.Response:
    # A stream, not content: a replica's body is read chunk by chunk, as over the network.
    body = httpx.ByteStream(json.dumps({"status": status}).encode())
    return httpx.Response(status, headers=headers, stream=body)


BEHAVIOUR = {
    "http://ok": lambda: answer(200, {"x-upstream": "yes"}),
    "http://broken": lambda: answer(500),
    "http://draining": lambda: answer(503, {DRAINING_HEADER: "1"}),
}


def handler(request: httpx.Request) -> httpx.Response:
    base = f"{request.url.scheme}://{request.url.host}"
    if base not in BEHAVIOUR:
        raise httpx.ConnectError("refused", request=request)
    return BEHAVIOUR[base]()


def forwarder() -> tuple[Forwarder, RouterMetrics, SessionMemory]:
    metrics = RouterMetrics()
    sessions = SessionMemory()
    forward = Forwarder(1.0, "prefix-affinity", ReplicaSet(), PrefixIndex(),
                        InFlight(metrics.in_flight), sessions, metrics)
    forward._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return forward, metrics, sessions


def routed(*urls: str) -> Routed:
    ranked = [Replica(url, url.removeprefix("http://"), healthy=True) for url in urls]
    return Routed(endpoint="completions", body=b"{}", headers={"content-type": "application/json"},
                  ranked=ranked, hashes=[1, 2], prompt_tokens=40, predicted_hit_tokens=16,
                  session="session-1", router_ms=0.25)


def send(forward: Forwarder, request: Routed) -> tuple[Response, bytes]:
    async def go() -> tuple[Response, bytes]:
        response = await forward.forward(request)
        body = b""
        if isinstance(response, StreamingResponse):
            async for chunk in response.body_iterator:
                body += chunk if isinstance(chunk, bytes) else str(chunk).encode()
        else:
            body = bytes(response.body)
        return response, body

    return asyncio.run(go())


def test_failures_before_the_first_byte_move_on_and_every_attempt_is_closed() -> None:
    forward, metrics, sessions = forwarder()
    request = routed("http://refused", "http://broken", "http://draining", "http://ok")
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


def test_the_last_replicas_error_is_the_clients_and_nothing_answering_is_a_502() -> None:
    forward, metrics, _ = forwarder()
    response, body = send(forward, routed("http://refused", "http://broken"))
    assert response.status_code == 500 and json.loads(body) == {"status": 500}
    response, body = send(forward, routed("http://refused", "http://gone"))
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
