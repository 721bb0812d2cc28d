"""kopf wiring: which events call which plain function. The work itself is in reconcile.py,
autoscale.py, status.py and periodic.py.

The handlers are sync functions where they call the API (kopf runs them in its thread pool),
serialised per object by the runtime's lock.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf

from kvscale.operator.inference_service import ObjectKey, inference_service_path
from kvscale.operator.kube import ApiError
from kvscale.operator.periodic import WORKS, periodic
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import GROUP, NAME_LABEL, PLURAL, VERSION
from kvscale.operator.status import refresh_status

log = logging.getLogger("kvscale.operator")


def on_spec(*, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Create, spec update, resume: converge the children."""
    reconcile(memo.runtime, ObjectKey.of(body), logger)


async def track(*, body: kopf.Body, event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Keep the index of InferenceServices the periodic loops walk; start the loops."""
    runtime: Runtime = memo.runtime
    key = ObjectKey.of(body)
    if event.get("type") == "DELETED":
        runtime.forget(key.uid)
    else:
        runtime.watched[key.uid] = key
    if getattr(memo, "periodic", None) is None:
        # Started from a handler, so that they inherit kopf's context (kopf.event needs it).
        memo.periodic = [asyncio.create_task(periodic(runtime, work), name=f"kvscale-{work}")
                         for work in WORKS]
        log.info("periodic reconcile every %.1fs, scrape every %.1fs",
                 runtime.config.resync_interval, runtime.config.scrape_interval)


async def stop_periodic(*, memo: kopf.Memo, **_: Any) -> None:
    for task in getattr(memo, "periodic", None) or []:
        task.cancel()


def deployment_changed(*, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger,
                       **_: Any) -> None:
    """Deployment status moves as pods become ready: report it without waiting for the resync."""
    runtime: Runtime = memo.runtime
    namespace = body["metadata"]["namespace"]
    owner_name = (body["metadata"].get("labels") or {}).get(NAME_LABEL)
    if not owner_name:
        return
    owner = runtime.kube.get(inference_service_path(namespace, owner_name))
    if owner is None or owner["metadata"].get("deletionTimestamp"):
        return
    with runtime.lock(owner["metadata"]["uid"]):
        try:
            refresh_status(runtime, owner_name, namespace)
        except ApiError as exc:
            logger.warning("status refresh for %s failed: %s", owner_name, exc)


def register(registry: kopf.OperatorRegistry) -> None:
    """Attach the handlers to `registry`. No kopf timers or daemons: see periodic.py."""
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.resume(*resource, registry=registry)(on_spec)
    kopf.on.create(*resource, registry=registry)(on_spec)
    kopf.on.update(*resource, field="spec", registry=registry)(on_spec)
    kopf.on.event(*resource, registry=registry)(track)
    kopf.on.cleanup(registry=registry)(stop_periodic)
    kopf.on.event("apps", "v1", "deployments", labels={NAME_LABEL: kopf.PRESENT},
                  registry=registry)(deployment_changed)
