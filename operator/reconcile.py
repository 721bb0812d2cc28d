"""Reconciling one InferenceService: its children applied, its status refreshed.

State-based and idempotent: every trigger (create, spec update, operator resume, the periodic
resync) applies the same desired children, so a restart or a repeated event never duplicates
anything.
"""

from __future__ import annotations

import kopf

from kvscale.operator.apply import apply_children
from kvscale.operator.conditions import INFERENCE_POOL_READY, SYNCED, Condition
from kvscale.operator.gateway_pool import sync_inference_pool
from kvscale.operator.inference_service import (
    ObjectKey,
    as_body,
    being_deleted,
    inference_service_path,
    typed_spec,
)
from kvscale.operator.kube import ApiError
from kvscale.operator.multi_node import refusal as multi_node_refusal
from kvscale.operator.multi_node import served_for
from kvscale.operator.runtime import Runtime
from kvscale.operator.status import AUTOSCALING_DISABLED, refresh_status


def reconcile(runtime: Runtime, key: ObjectKey, logger: kopf.Logger) -> None:
    with runtime.lock(key.uid):
        try:
            # Read again under the lock: the autoscaler may have changed spec.replicas since the
            # event was read, and applying the older value would undo its decision.
            current = runtime.kube.get(inference_service_path(key.namespace, key.name))
            if current is None or current["metadata"]["uid"] != key.uid or being_deleted(current):
                return  # gone, or the garbage collector is removing the children: make nothing
            spec = typed_spec(current)
            runtime.metrics.register(key.uid, key.namespace, key.name)
            generation = current["metadata"].get("generation")
            autoscaling = [] if spec.autoscaling.enabled else [AUTOSCALING_DISABLED]
            lws_served = served_for(runtime.lws, runtime.kube, spec, current.get("status") or {})
            refused = runtime.config.refusal(spec) or multi_node_refusal(spec, lws_served)
            if refused is not None:  # docs/operator.md, "What an InferenceService may choose"
                not_applied(runtime, key, refused.message, refused.reason, autoscaling)
                return
            try:
                conflicts = apply_children(runtime.kube, as_body(current), spec, runtime.config.images,
                                           runtime.config.server_defaults, lws_served)
            except ApiError as exc:
                not_applied(runtime, key, f"applying generation {generation} failed: {exc}",
                            "ApplyFailed", autoscaling)
                raise
            # Never fails the reconcile: without GIE's CRD the service serves as before.
            pool = sync_inference_pool(runtime.kube, as_body(current), spec)
            pool_conditions = [pool] if pool is not None else []
            dropped = () if pool is not None else (INFERENCE_POOL_READY,)
            if conflicts:  # the periodic resync tries again: nothing to raise
                not_applied(runtime, key, "; ".join(conflicts) + ": rename this InferenceService "
                            "or remove those objects", "NameConflict", [*autoscaling, *pool_conditions],
                            dropped)
                return
            refresh_status(runtime, key.name, key.namespace, applied_generation=generation,
                           extra_conditions=[*autoscaling, *pool_conditions, Condition(
                               SYNCED, True, "Applied", f"generation {generation} applied")],
                           dropped_conditions=dropped)
        except ApiError as exc:
            runtime.metrics.error(key.uid, key.namespace, key.name, "reconcile")
            if exc.status in (401, 403):
                logger.error("the operator lacks a permission: %s", exc)
            raise kopf.TemporaryError(str(exc), delay=runtime.config.resync_interval) from exc


def not_applied(runtime: Runtime, key: ObjectKey, message: str, reason: str,
                others: list[Condition], dropped: tuple[str, ...] = ()) -> None:
    """Synced=False with why, beside ``others``; status.observedGeneration stays where it was."""
    try:
        refresh_status(runtime, key.name, key.namespace,
                       extra_conditions=[*others, Condition(SYNCED, False, reason, message)],
                       dropped_conditions=dropped)
    except ApiError:
        pass  # the API that refused the children may refuse the status too: the error stands
