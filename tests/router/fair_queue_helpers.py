"""Driving a FairQueue from a test: one batch slot freed at a time."""

from __future__ import annotations

import asyncio

from kvscale.router.fair_queue import FairQueue


async def free_slots_one_by_one(queue: FairQueue, free: list[int], order: list[str], count: int) -> None:
    """Free one slot (``free[0]``, what the queue's room callback reads), dispatch, close it again,
    and wait for the request let through to record itself in ``order``; ``count`` times. The next
    slot frees only once the last one was taken, so ``order`` is the queue's order."""
    for served in range(len(order) + 1, len(order) + count + 1):
        free[0] = 1
        queue.dispatch()
        free[0] = 0
        while len(order) < served:
            await asyncio.sleep(0)
