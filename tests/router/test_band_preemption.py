"""A request more urgent than this router's open ones goes to full replicas that preempt
(router/band_preemption.py, and router/fair_queue.py's use of it; docs/router.md, "Fair share
when the fleet is saturated")."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import httpx
import pytest
from fair_queue_helpers import app_over_one_replica

from kvscale.kv_index_schema import Heartbeat
from kvscale.router.band_preemption import may_preempt
from kvscale.router.fair_queue import FairQueue, Turn
from kvscale.router.fleet_room import running_on
from kvscale.router.heartbeats import HeartbeatTable
from kvscale.router.metrics import RouterMetrics
from kvscale.router.replicas import Replica as RouterReplica
from tests.router.test_fair_share import MODEL, Replica


def test_a_request_goes_through_while_less_urgent_open_ones_outnumber_those_it_displaced() -> None:
    assert may_preempt(0, {10: 2}, 1)
    assert not may_preempt(0, {10: 2}, 2)  # each one let through so displaces one
    assert not may_preempt(10, {10: 3, 0: 1}, 0)  # equal bands never: the replicas would not preempt
    assert not may_preempt(0, {}, 0)


def test_less_urgent_sequences_the_replicas_run_for_other_routers_count_too() -> None:
    """Two routers share a flood of band 10: while the other one's requests fill the replica this
    router has none open there, and a band-0 request waited for a heartbeat to show a free slot,
    which the other router refills within a loop turn of each finish (up to ~1 s, 4 heartbeats).
    The replica's heartbeat says what it runs by priority: those it can displace count."""
    assert may_preempt(0, {}, 0, {10: 4})
    assert may_preempt(0, {10: 1}, 3, {10: 4})  # the larger of its own count and the fleet's
    assert not may_preempt(0, {}, 4, {10: 4})  # each one let through so displaces one
    assert not may_preempt(10, {}, 0, {10: 4, 0: 1})  # equal bands never
    assert not may_preempt(0, {}, 0, {0: 4})


def test_the_queue_lets_an_urgent_request_displace_another_routers_less_urgent_sequences() -> None:
    async def run() -> tuple[bool, bool]:
        queue = FairQueue(max_wait_s=5, replicas_preempt=True)
        running = {10: 4}  # the other router's flood holds every slot; this one has nothing open
        urgent = asyncio.ensure_future(queue.enter("high", 0, 1.0, 10, lambda: 0, running=lambda: running))
        low = asyncio.ensure_future(queue.enter("low", 10, 1.0, 10, lambda: 0, running=lambda: running))
        await asyncio.sleep(0)
        through = urgent.done(), low.done()
        for waiting in (urgent, low):
            waiting.cancel()
        await asyncio.gather(urgent, low, return_exceptions=True)
        return through

    assert asyncio.run(run()) == (True, False)


def test_the_replicas_heartbeats_carry_their_running_requests_by_priority_to_the_router() -> None:
    from kvscale.server.engine.kv_publisher import KVEventPublisher
    from kvscale.server.outputs import EngineStats

    beats = {}
    for rid, running in (("r0", {10: 3, 0: 1}), ("r1", {10: 2})):
        publisher = KVEventPublisher("redis://unused", rid, MODEL, f"http://{rid}", 16)
        publisher._latest_stats = EngineStats(4, 0, 100, 4, 0, 16, 0, 0, 0, running_by_priority=running)
        beats[rid] = Heartbeat.from_json(rid, publisher.heartbeat().to_json(), time.monotonic())
    heartbeats = HeartbeatTable(SimpleNamespace(heartbeats=beats, healthy=True))  # type: ignore[arg-type]
    replicas = [RouterReplica(f"http://{rid}", rid, healthy=True) for rid in beats]
    assert running_on(replicas, heartbeats) == {10: 5, 0: 1}
    assert running_on(replicas[1:], heartbeats) == {10: 2}


def test_the_queue_lets_an_urgent_request_through_to_full_replicas_only_when_they_preempt() -> None:
    async def run(replicas_preempt: bool) -> tuple[bool, bool]:
        queue = FairQueue(max_wait_s=5, replicas_preempt=replicas_preempt)
        free = [1]
        low = await queue.enter("low", 10, 1.0, 10, lambda: free[0])
        assert isinstance(low, Turn)
        low.forwarding(None)
        free[0] = 0  # the low one holds the only slot
        urgent = asyncio.ensure_future(queue.enter("high", 0, 1.0, 10, lambda: free[0]))
        second = asyncio.ensure_future(queue.enter("high", 0, 1.0, 10, lambda: free[0]))
        await asyncio.sleep(0)
        first_through, second_through = urgent.done(), second.done()
        low.done(200, b"")  # frees nothing the heartbeats show: the rest time out
        for waiting in (urgent, second):
            waiting.cancel()
        await asyncio.gather(urgent, second, return_exceptions=True)
        return first_through, second_through

    # One low request open: one urgent request displaces it, the next waits for room.
    assert asyncio.run(run(True)) == (True, False)
    assert asyncio.run(run(False)) == (False, False)


def test_a_request_whose_handling_fails_between_its_turn_and_its_forward_is_no_longer_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's app with --max-queue-wait and --scheduling-policy priority: a request let
    through whose handling raises before it is forwarded (here its decision) ends its turn. Else
    it stays open in its band until restart, and a more urgent request is let past the full
    fleet to displace a request that is not there."""
    async def run() -> tuple[int, int, int, int]:
        async with app_over_one_replica(Replica, MODEL, 0, policy="round-robin", max_queue_wait_s=0.3,
                                        scheduling_policy="priority") as (app, set_running):
            router = app.state.router
            decide = router.decider.decide

            def fails_once(*args: object, **kwargs: object) -> object:
                monkeypatch.setattr(router.decider, "decide", decide)
                raise RuntimeError("the decision failed")

            monkeypatch.setattr(router.decider, "decide", fails_once)
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
                with pytest.raises(RuntimeError, match="the decision failed"):
                    await client.post("/v1/completions", json={**body, "priority": 10})
                queue = router.queue
                still_open = sum(queue.open_by_band.values()) + len(queue.opened) + len(queue.unsent)
                set_running(1)  # full: another router's request holds the slot
                urgent = await client.post("/v1/completions", json={**body, "priority": 0})
                set_running(1, {10: 1})  # the heartbeat says the slot's request is a less urgent one
                displacing = await client.post("/v1/completions", json={**body, "priority": 0})
                return (still_open, queue.open_without_room, urgent.status_code, queue.waiting,
                        displacing.status_code)

    still_open, without_room, urgent, waiting, displacing = asyncio.run(run())
    assert (still_open, without_room) == (0, 0)
    # Nothing of this router's is open on the full replica, nor does the heartbeat name a less
    # urgent sequence there: the urgent one waits, then is shed. Once it does, it goes through.
    assert (urgent, waiting, displacing) == (503, 0, 200)


def test_a_handler_cancelled_while_it_waits_or_as_its_turn_comes_leaves_nothing_open() -> None:
    """The wait's handler cancelled (an ext_proc stream its gateway reset): waiting, it leaves
    the queue as a client that left; given its turn in the same loop pass, the turn ends."""
    async def run() -> tuple[FairQueue, RouterMetrics]:
        metrics = RouterMetrics()
        queue = FairQueue(max_wait_s=5, metrics=metrics, replicas_preempt=True)
        free = [0]
        waits = [asyncio.ensure_future(queue.enter("a", 10, 1.0, 10, lambda: free[0])) for _ in range(2)]
        await asyncio.sleep(0)
        assert queue.waiting == 2
        waits[0].cancel()
        await asyncio.sleep(0)
        assert queue.waiting == 1
        free[0] = 1
        queue.dispatch()  # the second one's turn, before its task runs again
        assert queue.opened and queue.unsent
        waits[1].cancel()
        for cancelled in waits:
            with contextlib.suppress(asyncio.CancelledError):
                await cancelled
        return queue, metrics

    queue, metrics = asyncio.run(run())
    assert queue.waiting == 0 and not queue.queues and not queue.opened and not queue.unsent
    assert sum(queue.open_by_band.values()) == 0 and queue.open_without_room == 0
    assert metrics.registry.get_sample_value("kvscale_router_queue_waits_total", {"outcome": "disconnected"}) == 1
