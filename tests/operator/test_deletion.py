"""Deletion without surprises, on the real apiserver.

1. An InferenceService carries no finalizer, so deleting it never waits for an operator: the
   garbage collector removes its children through owner references.
2. Reconciling an InferenceService that is being deleted creates nothing again.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import pytest
from operator_helpers import OperatorProcess, wait_for

from kvscale.operator.autoscale import autoscale
from kvscale.operator.config import OperatorConfig
from kvscale.operator.inference_service import ObjectKey
from kvscale.operator.kube import Kube, load_connection
from kvscale.operator.reconcile import reconcile
from kvscale.operator.runtime import Runtime

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
HOLD = "test.kvscale.io/hold"  # a finalizer of the test's own, keeping a deleted object around


def inference_service(name: str, namespace: str, finalizers: list[str] | None = None) -> dict:
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "finalizers": finalizers or []},
        "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 1},
    }


@pytest.fixture
def namespace(k8s_env) -> str:
    k8s_env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    name = f"deletion-{uuid.uuid4().hex[:6]}"
    k8s_env.kubectl("create", "namespace", name)
    return name


def test_reconciling_an_object_being_deleted_recreates_nothing(k8s_env, namespace: str) -> None:
    kube = Kube(load_connection(str(k8s_env.kubeconfig)))
    k8s_env.kubectl("apply", "-f", "-", input=json.dumps(inference_service("going", namespace, [HOLD])))
    k8s_env.kubectl("delete", "kvis", "going", "-n", namespace, "--wait=false")
    body = k8s_env.kubectl_json("get", "kvis", "going", "-n", namespace)
    assert body["metadata"].get("deletionTimestamp")
    runtime = Runtime(kube=kube, config=OperatorConfig())
    try:
        reconcile(runtime, ObjectKey.of(body), logging.getLogger("test"))
        autoscale(runtime, ObjectKey.of(body), logging.getLogger("test"))
        for kind in ("deployments", "services", "secrets"):
            made = k8s_env.kubectl_json("get", kind, "-n", namespace)["items"]
            assert [o["metadata"]["name"] for o in made if o["metadata"]["name"].startswith("going")] == []
    finally:
        k8s_env.kubectl("patch", "kvis", "going", "-n", namespace, "--type=merge",
                        "-p", '{"metadata":{"finalizers":null}}', check=False)
        kube.close()


def test_deletion_needs_no_running_operator(k8s_env, namespace: str, tmp_path: Path) -> None:
    operator_kubeconfig = k8s_env.kubeconfig_for_user(
        "system:serviceaccount:kvscale-system:kvscale-operator",
        ["system:serviceaccounts", "system:serviceaccounts:kvscale-system"])
    operator = OperatorProcess(operator_kubeconfig, tmp_path / "operator.log", "--namespace", namespace,
                               "--no-leader-elect", "--resync-interval", "1", "--scrape-interval", "1")
    try:
        k8s_env.kubectl("apply", "-f", "-", input=json.dumps(inference_service("kept", namespace)))
        wait_for("the operator's children",
                 lambda: k8s_env.kubectl("get", "deployment", "kept", "-n", namespace, check=False).returncode == 0,
                 timeout=60)
        wait_for("a few resync rounds", lambda: operator.log().count("\n") >= 0, timeout=1)
        body = k8s_env.kubectl_json("get", "kvis", "kept", "-n", namespace)
        assert body["metadata"].get("finalizers") in (None, []), body["metadata"]["finalizers"]
    finally:
        operator.stop()
    # No operator runs now: deletion completes anyway, and the children follow.
    k8s_env.kubectl("delete", "kvis", "kept", "-n", namespace, "--timeout=30s")
    wait_for("children garbage-collected",
             lambda: k8s_env.kubectl("get", "deployment", "kept", "-n", namespace, check=False).returncode != 0,
             timeout=60)
