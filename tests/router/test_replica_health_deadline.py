"""One replica's health check that never ends must not hold the others' checks: the whole check
(its /health and /v1/models calls) has a deadline of its own, past which it counts as failed. And
nothing ends the checks: a fault of the HTTP stack is a failed check, and a pass that raises is
logged and followed by the next."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from kvscale.router.replicas import FAILURES_TO_MARK_DOWN, ReplicaSet

GOOD, STUCK = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


async def _answer(request: httpx.Request) -> httpx.Response:
    if request.url.host == "10.0.0.2":
        await asyncio.Event().wait()  # accepted, never answered, never failed
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    return httpx.Response(200, json={"object": "list", "data": [{"id": "base"}]})


def checked(urls: list[str], answer: Any, passes: int, deadline_s: float | None = None) -> ReplicaSet:
    """A replica set over ``urls`` after ``passes`` passes of its health checks, each replica
    answered by ``answer`` (an httpx transport handler)."""
    async def run() -> ReplicaSet:
        replicas = ReplicaSet(health_interval_s=0.01)
        if deadline_s is not None:
            replicas.check_deadline_s = deadline_s
        replicas.set_urls(urls)
        replicas._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        for _ in range(passes):
            await asyncio.wait_for(replicas.check_all(), 5)
        await replicas._client.aclose()
        return replicas

    return asyncio.run(run())


def test_a_check_that_never_ends_fails_at_its_deadline_and_the_others_go_on() -> None:
    # The client's own timeouts do not apply inside a transport: the deadline must hold anyway.
    replicas = checked([GOOD, STUCK], _answer, 2, deadline_s=0.3)
    good, stuck = replicas.replicas[GOOD], replicas.replicas[STUCK]
    assert good.healthy and good.models == {"base"}
    assert not stuck.healthy and stuck.consecutive_failures == 2
    assert "no answer within 0.3 s" in stuck.status


BROKEN = "http://10.0.0.3:8000"


async def _broken_stack(request: httpx.Request) -> httpx.Response:
    if request.url.host == "10.0.0.3":
        # What anyio raises when the replica resets the connection as it is made: not an
        # httpx.HTTPError. Before, it ended the pass and, raised from the loop, every later one.
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")
    return await _answer(request)


def test_a_fault_of_the_http_stack_is_a_failed_check_and_the_checks_go_on() -> None:
    replicas = checked([GOOD, BROKEN], _broken_stack, FAILURES_TO_MARK_DOWN)
    good, broken = replicas.replicas[GOOD], replicas.replicas[BROKEN]
    assert good.healthy and good.models == {"base"}
    assert not broken.healthy and broken.consecutive_failures == FAILURES_TO_MARK_DOWN
    assert "the check failed: AttributeError" in broken.status


class _FailingFollower:
    """A follower whose every call raises: the checks must go on regardless."""

    def __init__(self) -> None:
        self.calls = 0

    def checked(self) -> None:
        self.calls += 1
        raise RuntimeError("a follower's bug")

    async def close(self) -> None:
        pass


def test_the_health_loop_outlives_a_pass_that_raises() -> None:
    async def run() -> tuple[ReplicaSet, _FailingFollower, bool]:
        replicas = ReplicaSet(health_interval_s=0.01)
        replicas.set_urls([GOOD])
        follower = _FailingFollower()
        replicas.followers.append(follower)
        replicas._client = httpx.AsyncClient(transport=httpx.MockTransport(_answer))
        loop = asyncio.create_task(replicas._loop())
        for _ in range(500):
            if follower.calls >= 3:
                break
            await asyncio.sleep(0.01)
        alive = not loop.done()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await replicas._client.aclose()
        return replicas, follower, alive

    replicas, follower, alive = asyncio.run(run())
    assert alive and follower.calls >= 3
    assert replicas.replicas[GOOD].healthy
