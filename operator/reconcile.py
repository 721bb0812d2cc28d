"""Reconciling one InferenceService: its children applied, its status refreshed.

State-based and idempotent: every trigger (create, spec update, operator resume, the periodic
resync) applies the same desired children, so a restart or a repeated event never duplicates
anything.
"""

from __future__ import annotations

import kopf

from kvscale.operator.apply import apply_children
from kvscale.operator.inference_service import (
    ObjectKey,
    as_body,
    being_deleted,
    inference_service_path,
    typed_spec,
)
from kvscale.operator.kube import ApiError
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
            apply_children(runtime.kube, as_body(current), spec, runtime.config.images)
            refresh_status(runtime, key.name, key.namespace, extra_conditions=(
                None if spec.autoscaling.enabled else [AUTOSCALING_DISABLED]))
        except ApiError as exc:
            runtime.metrics.error(key.uid, key.namespace, key.name, "reconcile")
            if exc.status in (401, 403):
                logger.error("the operator lacks a permission: %s", exc)
            raise kopf.TemporaryError(str(exc), delay=runtime.config.resync_interval) from exc
