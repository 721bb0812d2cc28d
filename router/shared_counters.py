"""The fair queue's tenant counters shared through Redis (kvscale.fair_share_schema; docs/router.md,
"Fair share across routers").

The queue decides on its own table of counters (router/fair_share.py's decisions stay pure and
synchronous, the counters their inputs); this keeps that table in step with the fleet's. Every
lift and charge the queue makes is sent to the shared counter in the background, and the counter
Redis answers with (every router's charges in it, plus this router's still on their way) replaces
the local one; while requests wait, their tenants' counters are read again every tick. The table
lags the fleet by a round trip or a tick. It also says, under an id of this router's own, which
tenants wait here (when a tenant's queue fills or empties, and every tick while it waits), so
that no router lifts a tenant still waiting at another (kvscale.fair_share_schema).

Falls back to the local counters: when Redis errors or does not answer within
``--redis-timeout-ms``, the queue goes on with this router's own charges, the gauge
``kvscale_router_fair_share_shared`` says 0 and the outage is logged once; Redis is left alone for
RETRY_AFTER_FAILURE_S, then tried again. Charges made during an outage stay local.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvscale.fair_share_schema import (
    LAST_SERVED_KEY,
    UPDATE_LUA,
    WAITING_LUA,
    Floor,
    counter_key,
    counters_from,
    update_args,
    waiting_args,
)
from kvscale.kv_index_schema import redacted_url
from kvscale.router.redis_pipe import RedisCalls, open_redis
from kvscale.router.tenants import MAX_TENANTS

log = logging.getLogger("kvscale.router")
RETRY_AFTER_FAILURE_S = 1.0
# Updates on their way to Redis at once; beyond, the local counter alone takes the next ones.
MAX_IN_FLIGHT = 256


class SharedCounters:
    def __init__(self, redis_url: str, timeout_s: float,
                 on_shared: Callable[[bool], None] = lambda shared: None) -> None:
        self.redis_url = redis_url
        self.timeout_s = timeout_s
        self._on_shared = on_shared
        self._redis: RedisCalls | None = None
        self.router_id = secrets.token_hex(8)  # this router's, for where its tenants wait
        self.down = False
        self._quiet_until = 0.0
        # This router's updates sent and not answered yet, per tenant: added to what Redis
        # answers, which may not hold them yet.
        self.pending: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # The latest update sent: the next one waits for it, so Redis runs this router's lifts
        # and charges in the order the queue made them (each task may take another connection).
        self._last_update: asyncio.Task[None] | None = None
        self._refreshing = False
        on_shared(True)

    def _calls(self) -> RedisCalls:
        """Made on first use, on the event loop that serves (its connection belongs to that loop);
        one pipelined connection (router/redis_pipe.py): these run beside the requests forwarded."""
        if self._redis is None:
            self._redis = open_redis(self.redis_url, self.timeout_s * 2)
        return self._redis

    def _open(self) -> bool:
        if self.down and time.monotonic() < self._quiet_until:
            return False
        return len(self._tasks) < MAX_IN_FLIGHT

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # told off the loop (a response finalized late): the local counter
            work.close()
            return None
        task = loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def update(self, tenant: str, floor: Floor, added: float, served: bool,
               apply: Callable[[float, float], None]) -> None:
        """Lift ``tenant``'s shared counter to ``floor`` (kvscale.fair_share_schema), add
        ``added`` and, when ``served``, make it the last served's; ``apply(counter,
        last_served)`` gets the answer. Nothing when Redis is down: the local counter only."""
        if not tenant or not self._open():
            return
        self.pending[tenant] = self.pending.get(tenant, 0.0) + added
        if not self._in_order(self._update_now(tenant, floor, added, served, apply)):
            self._unpend(tenant, added)

    def _in_order(self, work: Coroutine[Any, Any, None]) -> bool:
        """Run ``work`` once the latest update sent has ended, so Redis runs this router's
        lifts, charges and waiting tenants in the order the queue made them (each task may take
        another connection); False when it cannot run (no event loop)."""
        task = self._spawn(self._after(self._last_update, work))
        if task is None:
            work.close()  # never started: closed, as _spawn closes its own
            return False
        self._last_update = task
        return True

    @staticmethod
    async def _after(previous: asyncio.Task[None] | None, work: Coroutine[Any, Any, None]) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])  # never raises: a failed update ends quietly
        await work

    def _unpend(self, tenant: str, added: float) -> None:
        left = self.pending.get(tenant, 0.0) - added
        if abs(left) < 1e-9:
            self.pending.pop(tenant, None)
        else:
            self.pending[tenant] = left

    async def _update_now(self, tenant: str, floor: Floor, added: float, served: bool,
                          apply: Callable[[float, float], None]) -> None:
        try:
            answer = await self._calls().run_script(
                UPDATE_LUA, [], update_args(tenant, floor, added, served, self.router_id))
            counter, last = counters_from(list(answer))
        except Exception as exc:  # any failure means the same: the local counter
            self._unpend(tenant, added)
            self._failed(exc)
            return
        self._unpend(tenant, added)
        self._answered()
        if counter is not None and last is not None:
            apply(counter + self.pending.get(tenant, 0.0), last)

    def waiting(self, tenants: list[str], waiting: bool) -> None:
        """``tenants`` wait here now (or no longer), in order with the updates. Nothing when
        Redis is down: the other routers' word lapses and lifts go on as each router's own."""
        names = [t for t in tenants if t][:MAX_TENANTS]
        if not names or not self._open():
            return
        self._in_order(self._waiting_now(names, waiting))

    async def _waiting_now(self, names: list[str], waiting: bool) -> None:
        try:
            await self._calls().run_script(WAITING_LUA, [], waiting_args(self.router_id, names, waiting))
        except Exception as exc:  # as for an update: the local counters
            self._failed(exc)
            return
        self._answered()

    def refresh(self, tenants: list[str],
                apply: Callable[[dict[str, float], float | None], None]) -> None:
        """Read ``tenants``' counters and the last served's again (one read at a time);
        ``apply(counters, last_served)`` gets those Redis holds."""
        names = [t for t in tenants if t][:MAX_TENANTS]
        if self._refreshing or not names or not self._open():
            return
        self._refreshing = True
        if self._spawn(self._refresh_now(names, apply)) is None:
            self._refreshing = False

    async def _refresh_now(self, names: list[str],
                           apply: Callable[[dict[str, float], float | None], None]) -> None:
        try:
            raw = await self._calls().execute(
                "MGET", *[counter_key(t) for t in names], LAST_SERVED_KEY)
            values = counters_from(list(raw))
        except Exception as exc:
            self._failed(exc)
            return
        finally:
            self._refreshing = False
        self._answered()
        apply({t: v + self.pending.get(t, 0.0) for t, v in zip(names, values, strict=False)
               if v is not None}, values[-1])

    def _failed(self, exc: BaseException) -> None:
        self._quiet_until = time.monotonic() + RETRY_AFTER_FAILURE_S
        if not self.down:
            log.warning("fair-share counters are this router's own: Redis at %s failed (%s: %s); "
                        "they are shared again when it answers", redacted_url(self.redis_url),
                        type(exc).__name__, exc)
            self.down = True
            self._on_shared(False)

    def _answered(self) -> None:
        if self.down:
            log.info("fair-share counters are shared again: Redis answers")
            self.down = False
            self._on_shared(True)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s * 4)
        if self._redis is not None:
            try:
                await asyncio.wait_for(self._redis.aclose(), self.timeout_s * 40)
            except Exception:  # closing a client whose server is gone
                pass
