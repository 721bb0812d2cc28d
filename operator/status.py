"""An InferenceService's status from its Deployments and pods, with every condition transition
posted as an Event."""

from __future__ import annotations

from typing import Any

import kopf

from kvscale.operator import conditions, pod_status
from kvscale.operator.children.labels import router_name, selector_string, service_url
from kvscale.operator.children.leader_worker_set import API_VERSION as LWS_API_VERSION
from kvscale.operator.children.leader_worker_set import PLURAL as LWS_PLURAL
from kvscale.operator.children.leader_worker_set import leader_worker_set_name
from kvscale.operator.conditions import INFERENCE_POOL_READY, SCALING_ACTIVE, SYNCED, Condition
from kvscale.operator.hpa import EXTERNAL_AUTOSCALER
from kvscale.operator.inference_service import (
    as_body,
    being_deleted,
    inference_service_path,
    typed_spec,
)
from kvscale.operator.kube import Kube, path_for
from kvscale.operator.multi_node import as_rollout
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import InferenceServiceSpec

# Known without scraping: reported from the first status on, not a scrape later.
AUTOSCALING_DISABLED = Condition(SCALING_ACTIVE, False, "AutoscalingDisabled",
                                 "spec.replicas is left to the user or an external autoscaler")


def router_status(kube: Kube, name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    deployment = kube.get(path_for("apps/v1", "deployments", namespace, router_name(name)))
    counts = (deployment or {}).get("status") or {}
    return {
        "replicas": int(counts.get("replicas") or 0),
        "readyReplicas": int(counts.get("readyReplicas") or 0),
        "redis": "external" if spec.router.redis.external else "internal",
    }


def post_transitions(current: dict[str, Any], assessed: pod_status.Health,
                     updates: list[Condition]) -> None:
    """One Event per condition whose status or reason changed; Warning for a problem."""
    old_conditions = (current.get("status") or {}).get("conditions")
    for changed in conditions.transitions(old_conditions, updates):
        previous = conditions.find_condition(old_conditions, changed.type) or {}
        # Standing aside for an HPA is for the user to settle: always an Event, a Warning.
        external = changed.type == SCALING_ACTIVE and changed.reason == EXTERNAL_AUTOSCALER
        if (changed.type == SCALING_ACTIVE and previous.get("status") == changed.status_text
                and not external):
            continue  # its reason moves with every decision; scaling has its own Events
        is_problem = ((assessed.problem is not None and changed.reason == assessed.problem.reason)
                      or (changed.type in (SYNCED, INFERENCE_POOL_READY) and changed.status is False)
                      or external)
        kopf.event(as_body(current), type="Warning" if is_problem else "Normal",
                   reason=changed.reason,
                   message=f"{changed.type}={changed.status_text}: {changed.message}")


def refresh_status(runtime: Runtime, name: str, namespace: str,
                   extra: dict[str, Any] | None = None,
                   extra_conditions: list[Condition] | None = None,
                   applied_generation: int | None = None,
                   dropped_conditions: tuple[str, ...] = ()) -> None:
    """Status from the Deployment (the LeaderWorkerSet over several nodes) and the servers'
    pods (its leaders); written only when something changed.

    ``status.observedGeneration`` moves only to an ``applied_generation``: a generation whose
    children could not all be applied is not observed (the Synced condition says why).
    """
    kube = runtime.kube
    current = kube.get(inference_service_path(namespace, name))
    if current is None or being_deleted(current):
        return
    spec = typed_spec(current)
    if spec.engine.nodes > 1:  # its replicas are a LeaderWorkerSet's groups
        deployment = as_rollout(kube.get(path_for(LWS_API_VERSION, LWS_PLURAL, namespace,
                                                  leader_worker_set_name(name))))
    else:
        deployment = kube.get(path_for("apps/v1", "deployments", namespace, name))
    pods = kube.list(path_for("v1", "pods", namespace), selector_string(name))
    # A missing API-key Secret shows in the pods' status (CreateContainerConfigError): the
    # operator may not read Secrets, and needs not.
    assessed = pod_status.assess(spec.replicas, deployment, pods, spec.autoscaling.scales_to_zero,
                                 workload="LeaderWorkerSet" if spec.engine.nodes > 1 else "Deployment")
    router: dict[str, Any] | None = None
    if spec.router.enabled:
        router = router_status(kube, name, namespace, spec)
        assessed = pod_status.with_router(assessed, router["readyReplicas"])
    updates = assessed.conditions + list(extra_conditions or [])
    post_transitions(current, assessed, updates)
    old_status = current.get("status") or {}
    generation = current["metadata"].get("generation")
    status = {
        "replicas": assessed.replicas,
        "readyReplicas": assessed.ready_replicas,
        "updatedReplicas": assessed.updated_replicas,
        "selector": selector_string(name),
        "url": service_url(name, namespace, runtime.config.cluster_domain),
        "observedGeneration": (applied_generation if applied_generation is not None
                               else old_status.get("observedGeneration")),
        "conditions": conditions.merge_conditions(old_status.get("conditions"), updates, generation,
                                                  dropped=dropped_conditions),
        "router": router,
        **(extra or {}),
    }
    if any(old_status.get(key) != value for key, value in status.items()):
        kube.merge_patch(inference_service_path(namespace, name, "status"), {"status": status})
