"""Driving a FairQueue from a test: one batch slot freed at a time; the router's app over one
replica whose heartbeat the test sets."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

from kvscale.kv_index_schema import Heartbeat
from kvscale.processes import free_port
from kvscale.router.app import build_app
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


@contextlib.asynccontextmanager
async def app_over_one_replica(handler: type[BaseHTTPRequestHandler], model: str, running: int,
                               **config: Any) -> AsyncIterator[tuple[Any, Callable[..., None]]]:
    """The router's app (RouterConfig ``config``) started over one replica, ``handler`` served on
    loopback, once its health check passed; that replica's heartbeat held as the Redis feed would
    hold it, with ``running`` sequences of a batch of one. Yields the app and what sets
    ``running`` again (and, optionally, its running sequences by priority)."""
    from kvscale.router.config import RouterConfig

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    app = build_app(RouterConfig(replicas=[url], models=[], health_interval_s=0.05, **config))
    router = app.state.router
    await router.start()
    try:
        while not any(r.healthy for r in router.replicas.replicas.values()):
            await asyncio.sleep(0.02)
        rid = next(iter(router.replicas.replicas.values())).replica_id
        feed = SimpleNamespace(heartbeats={}, healthy=True, healthy_since=time.monotonic())

        def set_running(count: int, by_priority: dict[int, int] | None = None) -> None:
            feed.heartbeats[rid] = Heartbeat(rid, model, url, 16, count, 0, 1, 100, time.time(), max_num_seqs=1,
                                             running_by_priority=by_priority or {})

        set_running(running)
        router.heartbeats.feed = feed
        yield app, set_running
    finally:
        router.heartbeats.feed = None  # not a RedisFeed: nothing to stop
        await router.stop()
        server.shutdown()
        server.server_close()
