"""spec.router.inferencePool on the real kube-apiserver, reconciled by `kvscale operator` under its
own RBAC and admission policies (deploy/rbac.yaml), with GIE's released InferencePool CRD
(tests/cluster/module_crds.py): without the CRD the service serves and says what is missing; with it
the pool appears, owned by the InferenceService; turned off, the pool and its picker Service go.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from module_crds import INFERENCE_POOL, inference_pool_crd, namespace_without
from operator_helpers import OperatorProcess, wait_for

from kvscale.operator.kube import ApiError, Kube, load_connection, path_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

POOL_CRD = INFERENCE_POOL.name
OPERATOR = "system:serviceaccount:kvscale-system:kvscale-operator"
POOL = "inferencepools.inference.networking.k8s.io"


def inference_service(namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": namespace},
            "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 0, **spec}}


@pytest.fixture
def namespace(k8s_env) -> Iterator[str]:
    with namespace_without(k8s_env, INFERENCE_POOL, "pool") as name:
        yield name


def pool_condition(k8s_env, namespace: str) -> dict[str, Any] | None:
    body = k8s_env.kubectl_json("get", "kvis", "chat", "-n", namespace)
    return next((c for c in (body.get("status") or {}).get("conditions") or []
                 if c["type"] == "InferencePoolReady"), None)


def router_args(k8s_env, namespace: str) -> list[str]:
    router = k8s_env.kubectl_json("get", "deployment", "chat-router", "-n", namespace)
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


def absent(k8s_env, namespace: str, *what: str) -> bool:
    return k8s_env.kubectl("get", *what, "-n", namespace, check=False).returncode != 0


def test_the_pool_waits_for_its_crd_then_follows_the_spec(k8s_env, namespace: str, tmp_path: Path) -> None:
    operator_kubeconfig = k8s_env.kubeconfig_for_user(
        OPERATOR, ["system:serviceaccounts", "system:serviceaccounts:kvscale-system"])
    kube = Kube(load_connection(str(operator_kubeconfig)))
    operator = OperatorProcess(operator_kubeconfig, tmp_path / "operator.log", "--namespace", namespace,
                               "--no-leader-elect", "--resync-interval", "1", "--scrape-interval", "5")
    try:
        # The picker checks keys and tenants as the HTTP port does: the API server takes a pool
        # beside them (its CEL rules and schema, without creating anything).
        keyed = k8s_env.kubectl("apply", "--dry-run=server", "-f", "-", check=False, input=json.dumps(
            inference_service(namespace, apiKeySecretRef={"name": "key"}, router={
                "inferencePool": {"enabled": True},
                "tenants": [{"name": "team-a", "apiKeySecretRef": {"name": "team-a-key"}}]})))
        assert keyed.returncode == 0, keyed.stderr
        k8s_env.kubectl("apply", "-f", "-", input=json.dumps(
            inference_service(namespace, router={"inferencePool": {"enabled": True}})))
        # No CRD: the service reconciles all the same, and says what is missing.
        condition = wait_for("InferencePoolReady", lambda: pool_condition(k8s_env, namespace), timeout=30)
        assert condition["status"] == "False", condition
        assert condition["reason"] == "CRDNotInstalled" and POOL_CRD in condition["message"]
        body = k8s_env.kubectl_json("get", "kvis", "chat", "-n", namespace)
        synced = next(c for c in body["status"]["conditions"] if c["type"] == "Synced")
        assert synced["status"] == "True", synced
        args = router_args(k8s_env, namespace)
        assert args[args.index("--ext-proc-port") + 1] == "9002"
        picker = k8s_env.kubectl_json("get", "service", "chat-router", "-n", namespace)
        assert picker["spec"]["ports"][0]["port"] == 9002
        assert picker["spec"]["ports"][0]["appProtocol"] == "http2"

        events = k8s_env.kubectl_json("get", "events", "-n", namespace)["items"]
        assert any(e["reason"] == "CRDNotInstalled" and e["type"] == "Warning" for e in events)

        # The CRD installed: a resync creates the pool, with no restart.
        k8s_env.kubectl("apply", "--server-side", "-f", str(inference_pool_crd()))
        k8s_env.wait_established(POOL_CRD)

        def pool() -> dict[str, Any] | None:
            if absent(k8s_env, namespace, POOL, "chat"):
                return None
            return k8s_env.kubectl_json("get", POOL, "chat", "-n", namespace)

        made = wait_for("the InferencePool", pool, timeout=20)
        assert made["spec"]["selector"]["matchLabels"] == {"serving.kvscale.io/inferenceservice": "chat"}
        assert made["spec"]["targetPorts"] == [{"number": 8000}]
        ref = made["spec"]["endpointPickerRef"]
        assert (ref["name"], ref["port"], ref["failureMode"], ref.get("kind")) == (
            "chat-router", {"number": 9002}, "FailClose", "Service")
        owners = made["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o.get("controller")) for o in owners] == [
            ("InferenceService", "chat", True)]
        assert owners[0]["uid"] == body["metadata"]["uid"]
        condition = wait_for("InferencePoolReady True", lambda: (
            c if (c := pool_condition(k8s_env, namespace)) and c["status"] == "True" else None), timeout=10)
        assert condition["reason"] == "Applied"
        # The children policy holds the operator's pools to its own servers and router.
        stray = {**made, "metadata": {**made["metadata"], "name": "stray"},
                 "spec": {**made["spec"], "endpointPickerRef": {**ref, "name": "elsewhere"}}}
        for drop in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
            stray["metadata"].pop(drop, None)
        with pytest.raises(ApiError) as refused:
            kube.create(path_for("inference.networking.k8s.io/v1", "inferencepools", namespace), stray)
        assert refused.value.status == 403 and "own router" in refused.value.message

        # Turned off: the pool, its picker Service and the condition go; the routers pick no more.
        k8s_env.kubectl("patch", "kvis", "chat", "-n", namespace, "--type=merge",
                        "-p", '{"spec":{"router":{"inferencePool":{"enabled":false}}}}')
        wait_for("the pool deleted", lambda: absent(k8s_env, namespace, POOL, "chat"), timeout=15)
        wait_for("the condition dropped", lambda: pool_condition(k8s_env, namespace) is None, timeout=10)
        assert absent(k8s_env, namespace, "service", "chat-router")
        assert "--ext-proc-port" not in router_args(k8s_env, namespace)
        assert operator.alive(), operator.log()[-3000:]
    finally:
        kube.close()
        operator.stop()

