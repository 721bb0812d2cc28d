"""What the Deployment and its pods say about an InferenceService (pure).

Problems a user can act on (an image that won't pull, a GPU request no node can satisfy, a missing
Secret, a crashing server) become the reason of the Ready condition while nothing serves, or of
Progressing while older replicas still do.

A missing Secret (the API key's, say) is learnt from the pods, as the kubelet reports it, never by
reading Secrets: the operator's RBAC has no `get` on them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvscale.operator.conditions import PROGRESSING, READY, Condition

IMAGE_PULL_REASONS = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
# How a kubelet words a CreateContainerConfigError for a Secret an env var names: `secret "x" not
# found` (no such Secret) or `couldn't find key k in Secret ns/x` (no such key).
MISSING_SECRET = re.compile(r"\bsecret\b.* not found|couldn't find key .* in secret", re.IGNORECASE)


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


@dataclass(frozen=True)
class Health:
    replicas: int
    ready_replicas: int
    updated_replicas: int
    conditions: list[Condition]
    problem: Problem | None


def pod_problem(pod: dict[str, Any]) -> Problem | None:
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        if (condition.get("type") == "PodScheduled" and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"):
            return Problem("Unschedulable", f"pod {name} cannot be scheduled: {condition.get('message', '')}".strip())
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        detail = waiting.get("message", "")
        if reason in IMAGE_PULL_REASONS:
            return Problem("ImagePullError",
                           f"pod {name}: image {container.get('image', '')!r} cannot be pulled ({reason}) {detail}".strip())
        if reason == "CreateContainerConfigError":
            if MISSING_SECRET.search(detail):
                return Problem("SecretNotFound",
                               f"pod {name} cannot start: {detail} (create the Secret it names)")
            return Problem("ContainerConfigError", f"pod {name}: {detail}".strip())
        if reason == "CrashLoopBackOff":
            return Problem("CrashLoopBackOff",
                           f"pod {name}: container {container.get('name')} keeps crashing {detail}".strip())
    return None


def deployment_problem(deployment: dict[str, Any]) -> Problem | None:
    for condition in (deployment.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "ReplicaFailure" and condition.get("status") == "True":
            return Problem("ReplicaFailure", condition.get("message", ""))
        if (condition.get("type") == "Progressing" and condition.get("status") == "False"
                and condition.get("reason") == "ProgressDeadlineExceeded"):
            return Problem("ProgressDeadlineExceeded", condition.get("message", ""))
    return None


def assess(
    desired_replicas: int,
    deployment: dict[str, Any] | None,
    pods: list[dict[str, Any]],
    scales_to_zero: bool = False,
    workload: str = "Deployment",
) -> Health:
    """Counts and the Ready / Progressing conditions. With `scales_to_zero` (minReplicas 0) no
    ready replica is a normal state: the router holds requests and wakes the servers. `workload`:
    the kind the servers run as (a LeaderWorkerSet over several nodes), named while it is missing."""
    status = (deployment or {}).get("status") or {}
    replicas = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    # A Deployment the controller has not looked at since the last change says nothing yet.
    stale = deployment is not None and (
        status.get("observedGeneration", 0) < deployment.get("metadata", {}).get("generation", 0))

    problem = next((p for p in map(pod_problem, pods) if p is not None), None)
    if problem is None and deployment is not None:
        problem = deployment_problem(deployment)

    if deployment is None:
        ready_condition = Condition(READY, False, f"{workload}Missing", f"the {workload} is being created")
    elif desired_replicas == 0 and scales_to_zero:
        ready_condition = Condition(READY, True, "ScaledToZero",
                                    "no replica: the router holds requests and starts one on demand")
    elif desired_replicas == 0:
        ready_condition = Condition(READY, False, "ScaledToZero", "spec.replicas is 0")
    elif ready > 0:
        ready_condition = Condition(READY, True, "Serving", f"{ready}/{desired_replicas} replicas ready")
    elif problem is not None:
        ready_condition = Condition(READY, False, problem.reason, problem.message)
    elif scales_to_zero:
        ready_condition = Condition(READY, True, "ScalingFromZero",
                                    f"0/{desired_replicas} replicas ready: the router holds "
                                    "requests until one is")
    else:
        ready_condition = Condition(READY, False, "PodsNotReady",
                                    f"0/{desired_replicas} replicas ready (loading the model?)")

    settled = (not stale and replicas == desired_replicas and ready == desired_replicas
               and updated == desired_replicas)
    if problem is not None and not settled:
        progressing = Condition(PROGRESSING, False, problem.reason, problem.message)
    elif settled:
        progressing = Condition(PROGRESSING, False, "RolloutComplete",
                                f"{ready} replicas ready and up to date")
    else:
        progressing = Condition(
            PROGRESSING, True, "RollingOut",
            f"{updated} updated, {ready} ready, {replicas} existing of {desired_replicas} wanted")
    return Health(replicas=replicas, ready_replicas=ready, updated_replicas=updated,
                  conditions=[ready_condition, progressing], problem=problem)


def with_router(assessed: Health, router_ready: int) -> Health:
    """Requests reach the servers through the router: without a ready router pod nothing serves."""
    if router_ready > 0:
        return assessed
    conditions = [
        Condition(READY, False, "RouterNotReady",
                  "no router pod is ready (waiting for a ready server, or the router is starting)")
        if c.type == READY and c.status else c
        for c in assessed.conditions
    ]
    return Health(replicas=assessed.replicas, ready_replicas=assessed.ready_replicas,
                  updated_replicas=assessed.updated_replicas, conditions=conditions,
                  problem=assessed.problem)
