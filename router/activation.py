"""Holding requests while the service has no ready replica (scaled to zero, or coming up from it).

With `--hold-timeout` the router does not answer 503 when no replica can take a request: it holds
the request (its body already read), asks for a replica (`wake`, called at once and then every
`WAKE_INTERVAL_S` while anything is held, so a lost call or a restarted operator costs a second,
not a request), and releases it to the normal routing path as soon as a replica is routable.

A hold ends in one of four ways (`kvscale_router_holds_total{outcome}`): released; timeout (held
longer than the limit: 503 with Retry-After); full (the bounded queue of held requests was full on
arrival: 503 at once); disconnected (the client went away: its place is freed).

The decisions are pure functions (`admission`, `retry_after_s`, `idle_seconds`); `Activation`
keeps the counts and wakes the waiters. Only the router's event loop touches it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvscale.router.metrics import RouterMetrics

log = logging.getLogger("kvscale.router")

ROUTE, HOLD, FULL = "route", "hold", "full"
RELEASED, TIMEOUT, DISCONNECTED = "released", "timeout", "disconnected"
# While requests are held: how often the scale is asked for again, and how often a waiter looks
# whether its client is still there.
WAKE_INTERVAL_S = 1.0
POLL_INTERVAL_S = 0.25
DEFAULT_HOLD_QUEUE = 1024


@dataclass(frozen=True)
class HoldLimits:
    timeout_s: float  # longest hold before 503
    max_held: int = DEFAULT_HOLD_QUEUE  # held at once; one more is refused at once


def admission(available: bool, held: int, limits: HoldLimits | None) -> str:
    """ROUTE when a replica can take the request (or holding is off: the caller answers as
    before), HOLD while the queue has room, FULL when it has not."""
    if available or limits is None:
        return ROUTE
    return HOLD if held < limits.max_held else FULL


def retry_after_s(last_cold_start_s: float | None, limits: HoldLimits) -> int:
    """What a refused client is told to wait (whole seconds, at least 1): a cold start as long as
    the last one measured, or the hold limit when none was measured yet."""
    estimate = last_cold_start_s if last_cold_start_s is not None else limits.timeout_s
    return max(1, math.ceil(estimate))


def idle_seconds(now: float, last_activity: float, open_requests: int, held: int) -> float:
    """How long nothing has been open or held on this router (0 while something is)."""
    if open_requests > 0 or held > 0:
        return 0.0
    return max(0.0, now - last_activity)


class Activation:
    def __init__(self, limits: HoldLimits, metrics: RouterMetrics,
                 wake: Callable[[], Coroutine[Any, Any, None]] | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self._wake = wake
        self.held = 0
        self.available = False
        self.last_activity = time.monotonic()
        self.last_cold_start_s: float | None = None
        self.last_cold_start_ended: float | None = None  # monotonic
        self._ready = asyncio.Event()
        self._holding_since: float | None = None  # the first hold of the current cold start
        self._last_wake: float | None = None
        self._waking: asyncio.Task[None] | None = None

    def touch(self, now: float | None = None) -> None:
        """A request arrived or finished."""
        self.last_activity = time.monotonic() if now is None else now

    def update(self, available: bool, now: float | None = None) -> None:
        """Called as the replicas change (the router's sync loop): releases the held requests
        once a replica can take them, and asks for one again while they wait."""
        now = time.monotonic() if now is None else now
        self.available = available
        if available:
            if self._holding_since is not None:
                self.last_cold_start_s = now - self._holding_since
                self.last_cold_start_ended = now
                self.metrics.cold_start_seconds.observe(self.last_cold_start_s)
                log.info("a replica is ready %.1f s after the first held request; releasing %d",
                         self.last_cold_start_s, self.held)
                self._holding_since = None
            self._ready.set()
        else:
            self._ready.clear()
            if self.held:
                self._maybe_wake(now)

    def _maybe_wake(self, now: float) -> None:
        if self._wake is None or (self._waking is not None and not self._waking.done()):
            return
        if self._last_wake is not None and now - self._last_wake < WAKE_INTERVAL_S:
            return
        self._last_wake = now
        self._waking = asyncio.create_task(self._wake(), name="router-wake")

    async def hold(self, disconnected: Callable[[], Awaitable[bool]],
                   timeout_s: float | None = None) -> str:
        """Wait for a replica: RELEASED, TIMEOUT (after ``timeout_s``, the limit by default) or
        DISCONNECTED. The caller has checked `admission` first, and found no replica available
        (which this takes as the state until the next `update`)."""
        started = time.monotonic()
        self.available = False
        self._ready.clear()
        limit = self.limits.timeout_s if timeout_s is None else timeout_s
        if self._holding_since is None:
            self._holding_since = started
        self.held += 1
        self.metrics.held.set(self.held)
        self.touch(started)
        self._maybe_wake(started)
        outcome = TIMEOUT
        try:
            while True:
                if self.available:
                    outcome = RELEASED
                    break
                left = started + limit - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._ready.wait(), min(left, POLL_INTERVAL_S))
                except TimeoutError:
                    pass
                if not self.available and await disconnected():
                    outcome = DISCONNECTED
                    break
        finally:
            ended = time.monotonic()
            self.held -= 1
            self.metrics.held.set(self.held)
            self.metrics.holds.labels(outcome).inc()
            self.metrics.hold_seconds.observe(ended - started)
            self.touch(ended)
            if self.held == 0 and not self.available:
                self._holding_since = None  # nobody waits: the next hold starts a new cold start
        return outcome

    def refused(self) -> None:
        """A request turned away because the queue was full."""
        self.metrics.holds.labels(FULL).inc()

    async def stop(self) -> None:
        if self._waking is not None:
            self._waking.cancel()
