"""A request more urgent than this router's open ones goes to full replicas that preempt
(router/band_preemption.py, and router/fair_queue.py's use of it; docs/router.md, "Fair share
when the fleet is saturated")."""

from __future__ import annotations

import asyncio

from kvscale.router.band_preemption import may_preempt
from kvscale.router.fair_queue import FairQueue, Turn


def test_a_request_goes_through_while_less_urgent_open_ones_outnumber_those_it_displaced() -> None:
    assert may_preempt(0, {10: 2}, 1)
    assert not may_preempt(0, {10: 2}, 2)  # each one let through so displaces one
    assert not may_preempt(10, {10: 3, 0: 1}, 0)  # equal bands never: the replicas would not preempt
    assert not may_preempt(0, {}, 0)


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
