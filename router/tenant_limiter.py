"""Tenants' limits counted in the fleet's Redis: one atomic script per admission, one per
correction (kvscale.tenant_limits_schema), over one pipelined connection (router/redis_pipe.py):
the admission is the one round trip a limited tenant's request waits for before it is routed.

Fails open (docs/router.md, "Tenants"): serving matters more than limits, so when Redis errors or
does not answer within ``--redis-timeout-ms`` the request is let in unchecked, counted
(``on_unchecked``) and logged once per outage. A correction that fails is dropped: it only
refines a count that expires within the minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvscale.kv_index_schema import redacted_url
from kvscale.router.rate_limits import WindowCounts
from kvscale.router.redis_pipe import open_redis
from kvscale.router.tenants import Tenant
from kvscale.tenant_limits_schema import ADMIT_LUA, CORRECT_LUA, admit_args, correct_args

log = logging.getLogger("kvscale.router")
# After a failure Redis is left alone this long: an outage then costs requests nothing, not a
# timeout each.
RETRY_AFTER_FAILURE_S = 1.0


class TenantLimiter:
    def __init__(self, redis_url: str, timeout_s: float,
                 on_unchecked: Callable[[], None] = lambda: None) -> None:
        self.redis_url = redis_url
        self.timeout_s = timeout_s
        # A call gets twice --redis-timeout-ms: connecting, or a reply, may take one each.
        self._redis = open_redis(redis_url, timeout_s * 2)
        self._on_unchecked = on_unchecked
        self.down = False
        self._quiet_until = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: Tenant, tokens: int) -> WindowCounts | None:
        """The window's counts with this request (admitted when ``over`` is empty), or None when
        Redis could not say: the request goes in unchecked."""
        if self.down and time.monotonic() < self._quiet_until:
            self._on_unchecked()
            return None
        try:
            answer = await self._redis.run_script(ADMIT_LUA, [], admit_args(
                tenant.name, tenant.requests_per_minute, tenant.tokens_per_minute, tokens))
            counts = WindowCounts.from_script(answer)
        except Exception as exc:  # any failure means the same: serve unchecked
            self._unchecked(exc)
            return None
        if self.down:
            log.info("tenants' limits are checked again: Redis answers")
            self.down = False
        return counts

    def _unchecked(self, exc: BaseException) -> None:
        self._on_unchecked()
        self._quiet_until = time.monotonic() + RETRY_AFTER_FAILURE_S
        if not self.down:
            log.warning("tenants' limits unchecked: Redis at %s failed (%s: %s); requests are let "
                        "in without their limits until it answers", redacted_url(self.redis_url),
                        type(exc).__name__, exc)
            self.down = True

    def correct(self, tenant: str, window: int, delta: int) -> None:
        """Add ``delta`` tokens to the window a request was admitted in, in the background."""
        if delta:
            task = asyncio.get_running_loop().create_task(self._correct_now(tenant, window, delta))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _correct_now(self, tenant: str, window: int, delta: int) -> None:
        try:
            await self._redis.run_script(CORRECT_LUA, [], correct_args(tenant, window, delta))
        except Exception as exc:
            log.debug("a token correction for tenant %s was dropped: %s", tenant, exc)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.timeout_s * 4)
        try:
            await asyncio.wait_for(self._redis.aclose(), self.timeout_s * 40)
        except Exception:  # closing a client whose server is gone
            pass
