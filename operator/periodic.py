"""The periodic work, without kopf timers: two loops started with the operator, one reconciling
every watched InferenceService each --resync-interval, one autoscaling each --scrape-interval, so
a slow reconcile never delays a scaling decision.

kopf puts a finalizer on every object that has a timer or a daemon, and a deletion would then
wait for a running operator; the watch (registration.py) keeps the index these loops walk.
"""

from __future__ import annotations

import asyncio
import logging
import time

import kopf

from kvscale.operator.autoscale import autoscale
from kvscale.operator.kube import ApiError
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime

WORKS = ("autoscale", "reconcile")
log = logging.getLogger("kvscale.operator")


def due(now: float, last: float | None, interval: float) -> bool:
    return last is None or now - last >= interval


def interval_of(runtime: Runtime, work: str) -> float:
    return runtime.config.resync_interval if work == "reconcile" else runtime.config.scrape_interval


def periodic_round(runtime: Runtime, work: str, now: float) -> None:
    """One pass of `work` over the watched objects that are due; the handlers skip what is
    gone, replaced or being deleted."""
    handler = reconcile if work == "reconcile" else autoscale
    interval = interval_of(runtime, work)
    last_runs = runtime.last_runs.setdefault(work, {})
    for uid, key in list(runtime.watched.items()):
        if not due(now, last_runs.get(uid), interval):
            continue
        last_runs[uid] = now
        try:
            # Both handlers read the object afresh under its lock: the key is enough.
            handler(runtime, key, log)
        except (ApiError, kopf.TemporaryError, kopf.PermanentError) as exc:
            runtime.metrics.error(uid, key.namespace, key.name, work)
            log.warning("%s/%s: %s: %s", key.namespace, key.name, work, exc)


async def periodic(runtime: Runtime, work: str) -> None:
    """`work` for every watched object, forever."""
    interval = interval_of(runtime, work)
    while True:
        try:
            await asyncio.to_thread(periodic_round, runtime, work, time.monotonic())
        except Exception:  # a bug must not end the loop silently
            log.exception("periodic %s failed", work)
        await asyncio.sleep(min(interval / 4, 1.0))
