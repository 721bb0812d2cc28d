"""What the Deployment and its pods say about an InferenceService."""

from __future__ import annotations

import pytest

from kvscale.operator.conditions import PROGRESSING, READY
from kvscale.operator.pod_status import assess


def deployment(replicas=1, ready=1, updated=1, generation=1, observed=1, conditions=()):
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": list(conditions)}}


def pod(name="p-1", **status):
    return {"metadata": {"name": name}, "status": status}


def by_type(health):
    return {c.type: c for c in health.conditions}


def test_ready_and_settled():
    h = assess(2, deployment(2, 2, 2), [pod(), pod("p-2")])
    c = by_type(h)
    assert (c[READY].status, c[READY].reason) == (True, "Serving")
    assert (c[PROGRESSING].status, c[PROGRESSING].reason) == (False, "RolloutComplete")
    assert (h.replicas, h.ready_replicas) == (2, 2)


def test_rolling_out_while_serving():
    c = by_type(assess(3, deployment(2, 1, 1, generation=2, observed=2), [pod()]))
    assert c[READY].status is True
    assert (c[PROGRESSING].status, c[PROGRESSING].reason) == (True, "RollingOut")


def test_unschedulable_gpu_is_the_ready_reason_when_nothing_serves():
    pending = pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}])
    h = assess(1, deployment(1, 0, 1), [pending])
    c = by_type(h)
    assert (c[READY].status, c[READY].reason) == (False, "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in c[READY].message
    assert c[PROGRESSING].reason == "Unschedulable" and c[PROGRESSING].status is False


def test_image_pull_error_while_old_replicas_serve():
    pulling = pod("new", containerStatuses=[{"name": "server", "image": "bad:tag", "state": {
        "waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}])
    c = by_type(assess(2, deployment(3, 2, 1, generation=3, observed=3), [pod(), pod("b"), pulling]))
    assert c[READY].status is True
    assert (c[PROGRESSING].status, c[PROGRESSING].reason) == (False, "ImagePullError")
    assert "bad:tag" in c[PROGRESSING].message


def config_error(message: str) -> dict:
    return pod("new", containerStatuses=[{"name": "server", "state": {
        "waiting": {"reason": "CreateContainerConfigError", "message": message}}}])


@pytest.mark.parametrize("message", [
    'secret "llm-key" not found',  # a kubelet: no such Secret
    "couldn't find key api-key in Secret team/llm-key",  # a kubelet: no such key
    "secret 'llm-key' or its key 'api-key' not found",  # tests/cluster/kubelet.py
])
def test_a_missing_secret_is_learnt_from_the_pods(message):
    """Not by reading Secrets (the operator may not): from the kubelet's CreateContainerConfigError."""
    c = by_type(assess(1, deployment(1, 0, 1), [config_error(message)]))
    assert (c[READY].status, c[READY].reason) == (False, "SecretNotFound")
    assert "llm-key" in c[READY].message
    # Older replicas still serve: the rollout is stuck on it, not the service.
    c = by_type(assess(2, deployment(2, 1, 1, generation=2, observed=2), [pod(), config_error(message)]))
    assert c[READY].status is True
    assert (c[PROGRESSING].status, c[PROGRESSING].reason) == (False, "SecretNotFound")


def test_another_config_error_keeps_its_own_reason():
    c = by_type(assess(1, deployment(1, 0, 1), [config_error('configmap "settings" not found')]))
    assert c[READY].reason == "ContainerConfigError"


def test_crash_loop_and_stale_deployment():
    crashing = pod(containerStatuses=[{"name": "server", "state": {
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m"}}}])
    c = by_type(assess(1, deployment(1, 0, 1), [crashing]))
    assert c[READY].reason == "CrashLoopBackOff"
    # The controller has not seen the latest generation: not settled yet.
    c = by_type(assess(1, deployment(1, 1, 1, generation=4, observed=3), [pod()]))
    assert c[PROGRESSING].reason == "RollingOut"


def test_no_deployment_and_scaled_to_zero():
    assert by_type(assess(1, None, []))[READY].reason == "DeploymentMissing"
    assert by_type(assess(0, deployment(0, 0, 0), []))[READY].reason == "ScaledToZero"


def test_zero_replicas_is_a_normal_state_when_the_service_scales_to_zero():
    at_zero = by_type(assess(0, deployment(0, 0, 0), [], scales_to_zero=True))
    assert (at_zero[READY].status, at_zero[READY].reason) == (True, "ScaledToZero")
    assert (at_zero[PROGRESSING].status, at_zero[PROGRESSING].reason) == (False, "RolloutComplete")
    waking = by_type(assess(1, deployment(1, 0, 1), [pod()], scales_to_zero=True))
    assert (waking[READY].status, waking[READY].reason) == (True, "ScalingFromZero")
    # A real problem still shows while coming up from zero.
    broken = pod(containerStatuses=[{"name": "server", "image": "x",
                                     "state": {"waiting": {"reason": "ImagePullBackOff"}}}])
    assert by_type(assess(1, deployment(1, 0, 1), [broken], scales_to_zero=True))[READY].status is False
    # Scaled to zero by hand, without the router holding: not ready.
    assert by_type(assess(0, deployment(0, 0, 0), []))[READY].status is False


def test_a_missing_leader_worker_set_is_named_as_such():
    ready = by_type(assess(1, None, [], workload="LeaderWorkerSet"))[READY]
    assert (ready.reason, ready.message) == ("LeaderWorkerSetMissing", "the LeaderWorkerSet is being created")
