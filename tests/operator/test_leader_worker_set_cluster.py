"""spec.engine.nodes > 1 on the real kube-apiserver, reconciled by `kvscale operator` under its own
RBAC and admission policies (deploy/rbac.yaml), with LWS's released LeaderWorkerSet CRD
(tests/cluster/module_crds.py): without the CRD nothing is made and the condition says why; with it
the operator creates a LeaderWorkerSet the API server accepts (validated by the CRD's own schema,
and by the operator's children policy), with the ranks' key in a Secret it made; scaling changes
the LeaderWorkerSet's replicas; one node again gives the Deployment back.

No LWS controller runs here (it needs its webhook's certificates and a long Go build), so no pod
is ever made: the test asserts what the API server stores.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from module_crds import LEADER_WORKER_SET, leader_worker_set_crd, namespace_without
from operator_helpers import OperatorProcess, wait_for
from testenv import kwok_toleration

from kvscale.operator.kube import ApiError, Kube, load_connection, path_for

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

LWS_CRD = LEADER_WORKER_SET.name
OPERATOR = "system:serviceaccount:kvscale-system:kvscale-operator"
NODES = 3  # the bundled model's 9 heads split over 3 ranks: one GPU on each of 3 nodes


def inference_service(namespace: str, nodes: int = NODES) -> dict[str, Any]:
    return {"apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": namespace},
            "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 1,
                     "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                     "engine": {"nodes": nodes, "extraArgs": ["--num-gpu-blocks-override", "512"]},
                     "tolerations": [kwok_toleration()]}}


@pytest.fixture
def namespace(k8s_env) -> Iterator[str]:
    with namespace_without(k8s_env, LEADER_WORKER_SET, "lws") as name:
        yield name


def get(k8s_env, namespace: str, *what: str) -> dict[str, Any] | None:
    proc = k8s_env.kubectl("get", *what, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def synced(k8s_env, namespace: str) -> dict[str, Any] | None:
    body = get(k8s_env, namespace, "kvis", "chat") or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or []
                 if c["type"] == "Synced"), None)


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def test_a_replica_over_several_nodes_is_a_leader_worker_set_group(k8s_env, namespace: str,
                                                                   tmp_path: Path) -> None:
    operator_kubeconfig = k8s_env.kubeconfig_for_user(
        OPERATOR, ["system:serviceaccounts", "system:serviceaccounts:kvscale-system"])
    operator = OperatorProcess(operator_kubeconfig, tmp_path / "operator.log", "--namespace", namespace,
                               "--no-leader-elect", "--resync-interval", "1", "--scrape-interval", "5")
    try:
        k8s_env.kubectl("apply", "-f", "-", input=json.dumps(inference_service(namespace)))
        # No CRD: nothing is made, and the condition says what to install.
        condition = wait_for("Synced False", lambda: (
            c if (c := synced(k8s_env, namespace)) and c["status"] == "False" else None), timeout=30)
        assert condition["reason"] == "LeaderWorkerSetUnavailable", condition
        assert LWS_CRD in condition["message"] and "install LeaderWorkerSet" in condition["message"]
        for what in (("deployment", "chat"), ("secret", "chat-tp-authkey"), ("service", "chat")):
            assert get(k8s_env, namespace, *what) is None, what
        events = k8s_env.kubectl_json("get", "events", "-n", namespace)["items"]
        assert any(e["reason"] == "LeaderWorkerSetUnavailable" and e["type"] == "Warning" for e in events)

        # The CRD installed: a resync after the discovery's answer expires makes the group.
        k8s_env.kubectl("apply", "--server-side", "-f", str(leader_worker_set_crd()))
        k8s_env.wait_established(LWS_CRD)
        made = wait_for("the LeaderWorkerSet", lambda: get(
            k8s_env, namespace, "leaderworkersets.leaderworkerset.x-k8s.io", "chat-ranks"), timeout=40)
        kvis = get(k8s_env, namespace, "kvis", "chat")
        assert kvis is not None
        owners = made["metadata"]["ownerReferences"]
        assert [(o["kind"], o["name"], o["uid"], o.get("controller")) for o in owners] == [
            ("InferenceService", "chat", kvis["metadata"]["uid"], True)]
        spec = made["spec"]
        assert spec["replicas"] == 1 and spec["startupPolicy"] == "LeaderCreated"
        template = spec["leaderWorkerTemplate"]
        assert template["size"] == NODES and template["restartPolicy"] == "RecreateGroupOnPodRestart"
        [leader] = template["leaderTemplate"]["spec"]["containers"]
        [worker] = template["workerTemplate"]["spec"]["containers"]
        assert flag(leader["args"], "--tensor-parallel-size") == str(NODES)
        assert flag(leader["args"], "--nnodes") == str(NODES)
        assert flag(leader["args"], "--node-rank") == "0"
        assert flag(leader["args"], "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)" and "--headless" in worker["args"]
        assert flag(worker["args"], "--tensor-parallel-size") == str(NODES)
        assert "readinessProbe" in leader and "readinessProbe" not in worker
        for container in (leader, worker):
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
            [key] = [e for e in container["env"] if e["name"] == "KVSCALE_TP_AUTHKEY"]
            assert key["valueFrom"]["secretKeyRef"] == {"name": "chat-tp-authkey", "key": "authkey"}
        assert get(k8s_env, namespace, "deployment", "chat") is None
        # The key: made once by the operator, owned by the InferenceService, random.
        secret = get(k8s_env, namespace, "secret", "chat-tp-authkey")
        assert secret is not None
        assert [(o["kind"], o["uid"]) for o in secret["metadata"]["ownerReferences"]] == [
            ("InferenceService", kvis["metadata"]["uid"])]
        assert len(base64.b64decode(secret["data"]["authkey"])) >= 32
        assert kvis["status"]["tensorParallelSecret"] == "chat-tp-authkey"
        wait_for("Synced True", lambda: (c := synced(k8s_env, namespace)) and c["status"] == "True", timeout=15)
        # The Services select leaders only (the servers' label is on the leader template alone).
        pods_service = get(k8s_env, namespace, "service", "chat-pods")
        assert pods_service is not None
        assert pods_service["spec"]["selector"] == {"serving.kvscale.io/inferenceservice": "chat"}
        assert "serving.kvscale.io/inferenceservice" not in template["workerTemplate"]["metadata"]["labels"]
        # The children policy holds a LeaderWorkerSet's templates, the workers' too, to the
        # Deployments' rules: an image outside the allowed ones is refused to the operator.
        stray = json.loads(json.dumps(made))
        stray["metadata"] = {k: v for k, v in made["metadata"].items()
                             if k in ("namespace", "labels", "ownerReferences")} | {"name": "stray"}
        stray["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["image"] = (
            "registry.example/miner:1")
        kube = Kube(load_connection(str(operator_kubeconfig)))
        try:
            with pytest.raises(ApiError) as refused:
                kube.create(path_for("leaderworkerset.x-k8s.io/v1", "leaderworkersets", namespace), stray)
        finally:
            kube.close()
        assert refused.value.status == 403 and "allowed images" in refused.value.message

        # Scaling changes the groups.
        k8s_env.kubectl("scale", "kvis", "chat", "-n", namespace, "--replicas", "2")
        wait_for("two groups", lambda: (lws := get(
            k8s_env, namespace, "leaderworkersets.leaderworkerset.x-k8s.io", "chat-ranks"))
            and lws["spec"]["replicas"] == 2, timeout=15)
        assert get(k8s_env, namespace, "secret", "chat-tp-authkey")["data"] == secret["data"]  # not remade

        # One node again: the Deployment back, the LeaderWorkerSet gone.
        k8s_env.kubectl("patch", "kvis", "chat", "-n", namespace, "--type=merge",
                        "-p", '{"spec":{"engine":{"nodes":1}}}')
        deployment = wait_for("the Deployment", lambda: get(k8s_env, namespace, "deployment", "chat"), timeout=15)
        assert deployment["spec"]["replicas"] == 2
        wait_for("the LeaderWorkerSet deleted", lambda: get(
            k8s_env, namespace, "leaderworkersets.leaderworkerset.x-k8s.io", "chat-ranks") is None, timeout=15)
        assert operator.alive(), operator.log()[-3000:]
    finally:
        operator.stop()
