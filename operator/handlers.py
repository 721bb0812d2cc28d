"""kopf handlers: converge an InferenceService's children, report status, run the autoscaler.

Reconciliation is state-based and idempotent: every trigger (create, spec update, operator
resume, the periodic resync) server-side-applies the same desired children, so a restart or a
repeated event never duplicates anything. The handlers are sync functions (kopf runs them in its
thread pool) serialised per object by a lock, because the periodic loop and a watch event of the same object
may otherwise write its status at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import kopf

from kvscale.operator import (
    builders,
    conditions,
    health,
    redis_children,
    router_children,
    scaling,
    scraping,
)
from kvscale.operator.conditions import SCALING_ACTIVE, Condition
from kvscale.operator.kube import ApiError, Kube, object_path, path_for
from kvscale.operator.metrics import OperatorMetrics, ReplicaCounts
from kvscale.operator.spec import (
    GROUP,
    NAME_LABEL,
    PLURAL,
    VERSION,
    InferenceServiceSpec,
    parse_spec,
)

FIELD_MANAGER = "kvscale-operator"
API_VERSION = f"{GROUP}/{VERSION}"
log = logging.getLogger("kvscale.operator")


@dataclass(frozen=True)
class OperatorConfig:
    resync_interval: float = 10.0
    scrape_interval: float = 5.0
    scrape_timeout: float = 2.0
    allow_metrics_url_override: bool = False
    cluster_domain: str = "cluster.local"
    images: builders.Images = field(default_factory=builders.Images)


@dataclass
class Runtime:
    """What the handlers share, kept in kopf's memo."""

    kube: Kube
    config: OperatorConfig
    autoscalers: dict[str, scaling.AutoscalerState] = field(default_factory=dict)
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)
    watched: dict[str, tuple[str, str]] = field(default_factory=dict)  # uid -> (namespace, name)
    last_runs: dict[str, dict[str, float]] = field(default_factory=dict)  # work -> uid -> when
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def forget(self, uid: str) -> None:
        for runs in self.last_runs.values():
            runs.pop(uid, None)
        with self._locks_guard:
            self._locks.pop(uid, None)
        self.autoscalers.pop(uid, None)
        self.metrics.forget(uid)


def _is_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(API_VERSION, PLURAL, namespace, name, subresource)


def _typed_spec(body: kopf.Body | dict[str, Any]) -> InferenceServiceSpec:
    try:
        return parse_spec(dict(body.get("spec") or {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc


def _owned(child: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    kopf.adopt(child, owner=owner)
    return child


def apply_children(kube: Kube, owner: dict[str, Any], spec: InferenceServiceSpec,
                   images: builders.Images) -> None:
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if spec.router.enabled and not spec.router.redis.external:
        secret = redis_children.build_redis_secret(name, namespace)
        if kube.get(object_path(secret)) is None:
            try:
                kube.create(path_for("v1", "secrets", namespace), _owned(secret, owner))
            except ApiError as exc:
                if exc.status != 409:  # another reconcile made it first: keep that password
                    raise
    for child in builders.build_children(name, namespace, spec, images):
        kube.apply(object_path(child), _owned(child, owner), FIELD_MANAGER)
    for api_version, plural, child_name in builders.unwanted_children(name, namespace, spec):
        existing = kube.get(path_for(api_version, plural, namespace, child_name))
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        # Only what this InferenceService owns: never a same-named object a user made.
        if any(ref.get("uid") == meta["uid"] for ref in owners):
            kube.delete(path_for(api_version, plural, namespace, child_name))


def refresh_status(runtime: Runtime, name: str, namespace: str,
                   extra: dict[str, Any] | None = None,
                   extra_conditions: list[Condition] | None = None) -> None:
    """Status from the Deployment and pods, with condition transitions posted as Events."""
    kube = runtime.kube
    current = kube.get(_is_path(namespace, name))
    if current is None or current["metadata"].get("deletionTimestamp"):
        return
    spec = _typed_spec(current)
    deployment = kube.get(path_for("apps/v1", "deployments", namespace, name))
    pods = kube.list(path_for("v1", "pods", namespace), builders.selector_string(name))
    missing_secret = None
    if spec.api_key_secret is not None:
        if kube.get(path_for("v1", "secrets", namespace, spec.api_key_secret.name)) is None:
            missing_secret = spec.api_key_secret.name
    assessed = health.assess(spec.replicas, deployment, pods, missing_secret)
    router_status: dict[str, Any] | None = None
    if spec.router.enabled:
        router_deployment = kube.get(path_for("apps/v1", "deployments", namespace,
                                              router_children.router_name(name)))
        router_status = {
            "replicas": int(((router_deployment or {}).get("status") or {}).get("replicas") or 0),
            "readyReplicas": int(((router_deployment or {}).get("status") or {}).get("readyReplicas") or 0),
            "redis": "external" if spec.router.redis.external else "internal",
        }
        assessed = health.with_router(assessed, router_status["readyReplicas"])
    updates = assessed.conditions + list(extra_conditions or [])
    old_status = current.get("status") or {}
    old_conditions = old_status.get("conditions")
    generation = current["metadata"].get("generation")
    for changed in conditions.transitions(old_conditions, updates):
        previous = conditions.find_condition(old_conditions, changed.type) or {}
        if changed.type == SCALING_ACTIVE and previous.get("status") == changed.status_text:
            continue  # its reason moves with every decision; scaling has its own Events
        is_problem = assessed.problem is not None and changed.reason == assessed.problem.reason
        kopf.event(current, type="Warning" if is_problem else "Normal", reason=changed.reason,
                   message=f"{changed.type}={changed.status_text}: {changed.message}")
    status = {
        "replicas": assessed.replicas,
        "readyReplicas": assessed.ready_replicas,
        "updatedReplicas": assessed.updated_replicas,
        "selector": builders.selector_string(name),
        "url": builders.service_url(name, namespace, runtime.config.cluster_domain),
        "observedGeneration": generation,
        "conditions": conditions.merge_conditions(old_conditions, updates, generation),
        "router": router_status,
        **(extra or {}),
    }
    if any(old_status.get(key) != value for key, value in status.items()):
        kube.merge_patch(_is_path(namespace, name, "status"), {"status": status})


AUTOSCALING_DISABLED = Condition(SCALING_ACTIVE, False, "AutoscalingDisabled",
                                 "spec.replicas is left to the user or an external autoscaler")


def being_deleted(body: kopf.Body | dict[str, Any]) -> bool:
    return bool(body["metadata"].get("deletionTimestamp"))


def reconcile(runtime: Runtime, body: kopf.Body | dict[str, Any], logger: logging.Logger) -> None:
    meta = body["metadata"]
    with runtime.lock(meta["uid"]):
        try:
            # Read again under the lock: the autoscaler may have changed spec.replicas since
            # `body` was read, and applying the older value would undo its decision.
            current = runtime.kube.get(_is_path(meta["namespace"], meta["name"]))
            if current is None or current["metadata"]["uid"] != meta["uid"] or being_deleted(current):
                return  # gone, or the garbage collector is removing the children: make nothing
            spec = _typed_spec(current)
            owner = {"apiVersion": current["apiVersion"], "kind": current["kind"],
                     "metadata": dict(current["metadata"])}
            runtime.metrics.register(meta["uid"], meta["namespace"], meta["name"])
            apply_children(runtime.kube, owner, spec, runtime.config.images)
            # Known without scraping: reported from the first status on, not a scrape later.
            refresh_status(runtime, meta["name"], meta["namespace"], extra_conditions=(
                None if spec.autoscaling.enabled else [AUTOSCALING_DISABLED]))
        except ApiError as exc:
            runtime.metrics.error(meta["uid"], meta["namespace"], meta["name"], "reconcile")
            if exc.status in (401, 403):
                logger.error("the operator lacks a permission: %s", exc)
            raise kopf.TemporaryError(str(exc), delay=runtime.config.resync_interval) from exc


def set_deletion_costs(kube: Kube, pods: list[dict[str, Any]], loads: list[scaling.PodLoad]) -> None:
    """Fewest active KV blocks = cheapest to delete, so a scale-down keeps the warm caches."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    for load in loads:
        pod = by_name.get(load.pod)
        if pod is None or not load.has_metrics:
            continue
        cost = str(int(load.kv_blocks_active or 0))
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(builders.DELETION_COST_ANNOTATION) != cost:
            kube.merge_patch(path_for("v1", "pods", pod["metadata"]["namespace"], load.pod),
                             {"metadata": {"annotations": {builders.DELETION_COST_ANNOTATION: cost}}})


def autoscale(runtime: Runtime, body: kopf.Body, logger: logging.Logger) -> None:
    """Scrape the ready pods; keep deletion costs and kvUsage; when enabled, decide and scale."""
    kube, config = runtime.kube, runtime.config
    uid = body["metadata"]["uid"]
    with runtime.lock(uid):
        current = kube.get(_is_path(body["metadata"]["namespace"], body["metadata"]["name"]))
        if current is None or current["metadata"]["uid"] != uid or being_deleted(current):
            return
        spec = _typed_spec(current)
        name, namespace = current["metadata"]["name"], current["metadata"]["namespace"]
        pods = kube.list(path_for("v1", "pods", namespace), builders.selector_string(name))
        loads = scraping.scrape_pods(pods, config.scrape_timeout, config.allow_metrics_url_override)
        set_deletion_costs(kube, pods, loads)
        estimate = scaling.estimate_load(loads, spec.autoscaling)
        extra: dict[str, Any] = {}
        if estimate is not None:
            extra["kvUsage"] = round(estimate.kv_usage, 4)
            extra["waitingRequests"] = int(round(estimate.waiting))

        policy = spec.autoscaling
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = sum(1 for p in live if scraping.is_ready(p))
        if not policy.enabled:
            runtime.autoscalers.pop(uid, None)
            runtime.metrics.observe(uid, namespace, name, policy,
                                    ReplicaCounts(spec.replicas, len(live), ready),
                                    estimate, None, spec.replicas)
            refresh_status(runtime, name, namespace, extra, [AUTOSCALING_DISABLED])
            return

        state = runtime.autoscalers.get(uid, scaling.AutoscalerState())
        decision, runtime.autoscalers[uid] = scaling.decide(
            time.monotonic(), loads, spec.replicas, policy, state)
        extra["desiredReplicas"] = decision.replicas
        previous = spec.replicas
        runtime.metrics.observe(uid, namespace, name, policy,
                                ReplicaCounts(decision.replicas, len(live), ready),
                                estimate, decision, previous)
        if decision.replicas != previous:
            kube.merge_patch(_is_path(namespace, name, "scale"),
                             {"spec": {"replicas": decision.replicas}})
            spec = parse_spec({**current["spec"], "replicas": decision.replicas})
            apply_children(kube, current, spec, config.images)
            extra["lastScaleTime"] = conditions.now_rfc3339()
            direction = "up" if decision.replicas > previous else "down"
            message = (f"scaled {direction} from {previous} to "
                       f"{decision.replicas} replicas ({decision.reason}): {decision.message}")
            log.info("%s/%s: %s", namespace, name, message)
            kopf.event(current, type="Normal", reason="Scaled", message=message)
        active = decision.estimate is not None
        scaling_condition = Condition(
            SCALING_ACTIVE, active, decision.reason if active else "NoMetrics", decision.message)
        refresh_status(runtime, name, namespace, extra, [scaling_condition])


def due(now: float, last: float | None, interval: float) -> bool:
    return last is None or now - last >= interval


def periodic_round(runtime: Runtime, work: str, now: float) -> None:
    """One pass of `work` ("reconcile" every resync interval, "autoscale" every scrape
    interval) over the watched objects that are due; the handlers skip what is gone, replaced or
    being deleted."""
    handler, interval = ((reconcile, runtime.config.resync_interval) if work == "reconcile"
                         else (autoscale, runtime.config.scrape_interval))
    last_runs = runtime.last_runs.setdefault(work, {})
    for uid, (namespace, name) in list(runtime.watched.items()):
        if not due(now, last_runs.get(uid), interval):
            continue
        last_runs[uid] = now
        try:
            # Both handlers read the object afresh under its lock: the index's key is enough.
            handler(runtime, {"metadata": {"uid": uid, "namespace": namespace, "name": name}}, log)
        except (ApiError, kopf.TemporaryError, kopf.PermanentError) as exc:
            runtime.metrics.error(uid, namespace, name, work)
            log.warning("%s/%s: %s: %s", namespace, name, work, exc)


async def periodic(runtime: Runtime, work: str) -> None:
    """`work` for every watched object, forever; reconcile and autoscale run as two such loops,
    so a slow reconcile never delays a scaling decision."""
    interval = runtime.config.resync_interval if work == "reconcile" else runtime.config.scrape_interval
    while True:
        try:
            await asyncio.to_thread(periodic_round, runtime, work, time.monotonic())
        except Exception:  # a bug must not end the loop silently
            log.exception("periodic %s failed", work)
        await asyncio.sleep(min(interval / 4, 1.0))


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Attach the handlers to `registry`, with the timer intervals from `config`."""
    resource = (GROUP, VERSION, PLURAL)

    def on_spec(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        reconcile(memo.runtime, body, logger)

    for decorator in (kopf.on.resume(*resource, registry=registry),
                      kopf.on.create(*resource, registry=registry),
                      kopf.on.update(*resource, field="spec", registry=registry)):
        decorator(on_spec)

    # No kopf timers or daemons: kopf puts a finalizer on every object that has one, and a
    # deletion would then wait for a running operator. The watch keeps an index of the objects;
    # one loop started with the operator does the periodic work (resync, scrape, autoscale).
    @kopf.on.event(*resource, registry=registry)
    async def track(body: kopf.Body, event: dict[str, Any], memo: kopf.Memo, **_: Any) -> None:
        meta = body["metadata"]
        if event.get("type") == "DELETED":
            memo.runtime.watched.pop(meta["uid"], None)
            memo.runtime.forget(meta["uid"])
        else:
            memo.runtime.watched[meta["uid"]] = (meta["namespace"], meta["name"])
        if getattr(memo, "periodic", None) is None:
            # Started from a handler, so that they inherit kopf's context (kopf.event needs it).
            memo.periodic = [asyncio.create_task(periodic(memo.runtime, work), name=f"kvscale-{work}")
                             for work in ("autoscale", "reconcile")]
            log.info("periodic reconcile every %.1fs, scrape every %.1fs",
                     memo.runtime.config.resync_interval, memo.runtime.config.scrape_interval)

    @kopf.on.cleanup(registry=registry)
    async def stop_periodic(memo: kopf.Memo, **_: Any) -> None:
        for task in getattr(memo, "periodic", None) or []:
            task.cancel()

    # Deployment status moves as pods become ready: report it without waiting for the resync.
    @kopf.on.event("apps", "v1", "deployments", labels={NAME_LABEL: kopf.PRESENT},
                   registry=registry)
    def deployment_changed(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
                           **_: Any) -> None:
        runtime: Runtime = memo.runtime
        meta = body["metadata"]
        owner_name = (meta.get("labels") or {}).get(NAME_LABEL)
        owner = runtime.kube.get(_is_path(meta["namespace"], owner_name)) if owner_name else None
        if owner is None or owner["metadata"].get("deletionTimestamp"):
            return
        with runtime.lock(owner["metadata"]["uid"]):
            try:
                refresh_status(runtime, owner_name, meta["namespace"])
            except ApiError as exc:
                logger.warning("status refresh for %s failed: %s", owner_name, exc)
