"""The periodic work, without kopf timers: two loops started with the operator, one reconciling
every watched InferenceService each --resync-interval, one autoscaling each --scrape-interval, so
a slow reconcile never delays a scaling decision.

Within a loop the InferenceServices run side by side on a pool of threads, and one whose last
run has not ended is skipped, not waited for: a slow pod or API call in one namespace delays
that InferenceService alone (docs/operator.md, "Scraping"). The loops' progress and each run's
age feed the operator's /healthz (probes.py): a loop that stops turning, or a run stuck far past
any bound it has, makes it fail.

kopf puts a finalizer on every object that has a timer or a daemon, and a deletion would then
wait for a running operator; the watch (registration.py) keeps the index these loops walk.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import kopf

from kvscale.operator.autoscale import autoscale
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import ApiError
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime

WORKS = ("autoscale", "reconcile")
# InferenceServices handled at once by each loop; each autoscale run scrapes its pods on
# threads of its own (scraping.py).
WORKERS = 8
# A run is stuck, not slow, past this: its API calls time out after 30 s and its scrapes after
# twice the scrape timeout, so only a wedged lock or thread lives this long.
RUN_STALL_S = 300.0
log = logging.getLogger("kvscale.operator")
Handler = Callable[[Runtime, ObjectKey, kopf.Logger], None]


def due(now: float, last: float | None, interval: float) -> bool:
    return last is None or now - last >= interval


def interval_of(runtime: Runtime, work: str) -> float:
    return runtime.config.resync_interval if work == "reconcile" else runtime.config.scrape_interval


def run_one(runtime: Runtime, work: str, handler: Handler, uid: str, key: ObjectKey) -> None:
    try:
        # The handlers read the object afresh under its lock: the key is enough.
        handler(runtime, key, log)
    except (ApiError, kopf.TemporaryError, kopf.PermanentError) as exc:
        runtime.metrics.error(uid, key.namespace, key.name, work)
        log.warning("%s/%s: %s: %s", key.namespace, key.name, work, exc)
    except Exception:  # a bug must not end the loop silently
        log.exception("%s/%s: %s failed", key.namespace, key.name, work)
    finally:
        runtime.in_flight.setdefault(work, {}).pop(uid, None)


def periodic_round(runtime: Runtime, work: str, now: float, pool: Executor) -> None:
    """Start `work` on each watched object that is due and not still running from before; the
    handlers skip what is gone, replaced or being deleted."""
    handler: Handler = reconcile if work == "reconcile" else autoscale
    interval = interval_of(runtime, work)
    last_runs = runtime.last_runs.setdefault(work, {})
    in_flight = runtime.in_flight.setdefault(work, {})
    for uid, key in list(runtime.watched.items()):
        if uid in in_flight or not due(now, last_runs.get(uid), interval):
            continue
        last_runs[uid] = in_flight[uid] = now
        # In the caller's context: kopf.event reads kopf's settings from context variables, which
        # a pool's thread does not inherit (asyncio.to_thread copies them the same way).
        pool.submit(contextvars.copy_context().run, run_one, runtime, work, handler, uid, key)
    runtime.rounds[work] = now


def stalled(runtime: Runtime, now: float) -> str | None:
    """Why the periodic work is stuck, for /healthz; None while it turns."""
    for work, last in list(runtime.rounds.items()):
        limit = max(30.0, 3 * interval_of(runtime, work))
        if now - last > limit:
            return f"periodic {work}: no round for {now - last:.0f} s (limit {limit:.0f} s)"
    for work, runs in list(runtime.in_flight.items()):
        for uid, started in list(runs.items()):
            if now - started > RUN_STALL_S:
                key = runtime.watched.get(uid)
                what = f"{key.namespace}/{key.name}" if key else uid
                return f"periodic {work} of {what}: running for {now - started:.0f} s"
    return None


async def periodic(runtime: Runtime, work: str) -> None:
    """`work` for every watched object, forever."""
    interval = interval_of(runtime, work)
    pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix=f"kvscale-{work}")
    try:
        while True:
            try:
                periodic_round(runtime, work, time.monotonic(), pool)
            except Exception:  # a bug must not end the loop silently
                log.exception("periodic %s failed", work)
            await asyncio.sleep(min(interval / 4, 1.0))
    finally:
        # Not waited for: a cancelled loop must not block the event loop on a running scrape.
        pool.shutdown(wait=False, cancel_futures=True)
