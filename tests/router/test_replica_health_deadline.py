"""One replica's health check that never ends must not hold the others' checks: the whole check
(its /health and /v1/models calls) has a deadline of its own, past which it counts as failed."""

from __future__ import annotations

import asyncio

import httpx

from kvscale.router.replicas import ReplicaSet

GOOD, STUCK = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


async def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.host == "10.0.0.2":
        await asyncio.Event().wait()  # accepted, never answered, never failed
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    return httpx.Response(200, json={"object": "list", "data": [{"id": "base"}]})


def test_a_check_that_never_ends_fails_at_its_deadline_and_the_others_go_on() -> None:
    async def run() -> ReplicaSet:
        replicas = ReplicaSet(health_interval_s=0.05)
        replicas.check_deadline_s = 0.3
        replicas.set_urls([GOOD, STUCK])
        # The client's own timeouts do not apply inside a transport: the deadline must hold anyway.
        replicas._client = httpx.AsyncClient(transport=httpx.MockTransport(_answer))
        for _ in range(2):
            await asyncio.wait_for(replicas.check_all(), 5)
        await replicas._client.aclose()
        return replicas

    replicas = asyncio.run(run())
    good, stuck = replicas.replicas[GOOD], replicas.replicas[STUCK]
    assert good.healthy and good.models == {"base"}
    assert not stuck.healthy and stuck.consecutive_failures == 2
    assert "no answer within 0.3 s" in stuck.status
