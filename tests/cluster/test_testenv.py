"""The local control plane behaves like a cluster the operator can rely on:
a GPU node, scheduling onto it, pods kwok reports Ready, garbage collection,
RBAC enforcement, and the `up`/`status`/`down` commands behind make k8s-env."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from testenv import (
    COMPONENTS,
    CPU_NODE_NAME,
    FAKE_NODE_GPUS,
    FAKE_NODE_NAME,
    POD_CIDR,
    K8sEnv,
    K8sEnvError,
    kwok_toleration,
)

from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _namespace(env: K8sEnv, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    env.kubectl("create", "namespace", name)
    return name


def _gpu_deployment(name: str, namespace: str, gpus: int, replicas: int = 1) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "tolerations": [kwok_toleration()],
                    "containers": [
                        {
                            "name": "server",
                            "image": "kvscale:test",
                            "resources": {
                                "requests": {"nvidia.com/gpu": str(gpus), "cpu": "1"},
                                "limits": {"nvidia.com/gpu": str(gpus)},
                            },
                        }
                    ],
                },
            },
        },
    }


def test_fake_gpu_node_is_ready_with_gpus(k8s_env: K8sEnv) -> None:
    node = k8s_env.kubectl_json("get", "node", FAKE_NODE_NAME)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["Ready"] == "True"
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == str(FAKE_NODE_GPUS)
    assert node["status"]["capacity"]["nvidia.com/gpu"] == str(FAKE_NODE_GPUS)
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"} in node["spec"][
        "taints"
    ]

    version = json.loads(k8s_env.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"].startswith("v1.34.")


def test_gpu_deployment_is_scheduled_on_the_fake_node_and_ready(k8s_env: K8sEnv) -> None:
    namespace = _namespace(k8s_env, "sched")
    k8s_env.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(_gpu_deployment("gpu-app", namespace, gpus=2, replicas=2)),
    )
    k8s_env.kubectl(
        "rollout", "status", "deployment/gpu-app", "-n", namespace, "--timeout=120s", timeout=150
    )

    pods = k8s_env.kubectl_json("get", "pods", "-n", namespace, "-l", "app=gpu-app")["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == FAKE_NODE_NAME
        assert pod["status"]["phase"] == "Running"
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True"
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)
        # Loopback, so nothing that dials a pod (the operator's scraper) ever leaves the machine.
        assert ipaddress.ip_address(pod["status"]["podIP"]).is_loopback
    deployment = k8s_env.kubectl_json("get", "deployment", "gpu-app", "-n", namespace)
    assert deployment["status"]["readyReplicas"] == 2


def test_more_gpus_than_the_node_has_stays_pending(k8s_env: K8sEnv) -> None:
    namespace = _namespace(k8s_env, "toobig")
    too_many = FAKE_NODE_GPUS + 1
    k8s_env.kubectl(
        "apply", "-f", "-", input=json.dumps(_gpu_deployment("huge", namespace, too_many))
    )

    def failed_scheduling_event():
        events = k8s_env.kubectl_json(
            "get", "events", "-n", namespace, "--field-selector", "reason=FailedScheduling"
        )["items"]
        return [e for e in events if "Insufficient nvidia.com/gpu" in e["message"]]

    wait_until(failed_scheduling_event, 90, interval=0.5, what="a FailedScheduling event for nvidia.com/gpu")
    pods = k8s_env.kubectl_json("get", "pods", "-n", namespace, "-l", "app=huge")["items"]
    assert [p["status"]["phase"] for p in pods] == ["Pending"]
    assert "nodeName" not in pods[0]["spec"]


def test_deleting_a_deployment_garbage_collects_its_replicaset_and_pods(k8s_env: K8sEnv) -> None:
    namespace = _namespace(k8s_env, "gc")
    k8s_env.kubectl("apply", "-f", "-", input=json.dumps(_gpu_deployment("doomed", namespace, 1)))
    k8s_env.kubectl(
        "rollout", "status", "deployment/doomed", "-n", namespace, "--timeout=120s", timeout=150
    )

    def owned() -> list[str]:
        out = k8s_env.kubectl(
            "get", "replicasets,pods", "-n", namespace, "-l", "app=doomed", "-o", "name"
        )
        return out.stdout.split()

    assert len(owned()) == 2  # one ReplicaSet, one Pod
    # No --cascade flag: the default background deletion leaves the children
    # to the controller-manager's garbage collector, which is what is tested.
    k8s_env.kubectl("delete", "deployment", "doomed", "-n", namespace, "--wait=true")
    wait_until(lambda: not owned(), 90, interval=0.5, what="the ReplicaSet and Pod to be garbage-collected")


def test_rbac_is_enforced_for_a_restricted_identity(k8s_env: K8sEnv) -> None:
    namespace = _namespace(k8s_env, "rbac")
    k8s_env.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    k8s_env.kubectl(
        "create", "role", "pod-reader", "-n", namespace, "--verb=get,list,watch", "--resource=pods"
    )
    k8s_env.kubectl(
        "create",
        "rolebinding",
        "reader-reads-pods",
        "-n",
        namespace,
        "--role=pod-reader",
        f"--serviceaccount={namespace}:reader",
    )

    for kubeconfig in (
        k8s_env.kubeconfig_for_service_account(namespace, "reader"),  # client cert
        k8s_env.kubeconfig_with_token(namespace, "reader"),  # real bound token
    ):
        whoami = json.loads(
            k8s_env.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout
        )
        assert (
            whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"
        )

        allowed = k8s_env.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig)
        assert allowed.returncode == 0

        for forbidden in (
            ("create", "configmap", "x", "-n", namespace, "--from-literal=a=b"),  # verb not granted
            ("delete", "pod", "anything", "-n", namespace),  # verb not granted
            ("get", "pods", "-n", "default"),  # other namespace
            ("get", "nodes"),  # cluster scope
        ):
            denied = k8s_env.kubectl(*forbidden, kubeconfig=kubeconfig, check=False)
            assert denied.returncode != 0, forbidden
            assert "Forbidden" in denied.stderr or "forbidden" in denied.stderr, denied.stderr


def test_unknown_user_cannot_do_anything(k8s_env: K8sEnv) -> None:
    stranger = k8s_env.kubeconfig_for_user("stranger", ["nobody-group"])
    denied = k8s_env.kubectl("get", "pods", "-A", kubeconfig=stranger, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr.lower()
    with pytest.raises(K8sEnvError, match="Forbidden"):
        k8s_env.kubectl("create", "namespace", "not-yours", kubeconfig=stranger)


def test_cli_up_status_down_leaves_no_process_behind(k8s_bins: Path, tmp_path: Path) -> None:
    """`make k8s-env` / `make k8s-env-down` run exactly this."""
    workdir = tmp_path / "cli-env"
    command = [sys.executable, "-m", "testenv"]
    common = ["--workdir", str(workdir), "--bins", str(k8s_bins)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "tests" / "cluster")}
    up = subprocess.run(
        [*command, "up", *common], capture_output=True, text=True, env=env, timeout=300
    )
    assert up.returncode == 0, up.stderr + up.stdout
    assert f"export KUBECONFIG={workdir / 'kubeconfig'}" in up.stdout

    state = K8sEnv.load(workdir)
    pids = dict(state.pids)
    assert set(pids) == set(COMPONENTS)
    try:
        status = subprocess.run(
            [*command, "status", *common], capture_output=True, text=True, env=env, timeout=60
        )
        assert status.returncode == 0, status.stdout
        # A second `up` finds it running and starts nothing new.
        again = subprocess.run(
            [*command, "up", *common], capture_output=True, text=True, env=env, timeout=60
        )
        assert again.returncode == 0 and "already up" in again.stdout
        assert K8sEnv.load(workdir).pids == pids
        nodes = state.kubectl_json("get", "nodes")["items"]
        assert [n["metadata"]["name"] for n in nodes] == sorted([CPU_NODE_NAME, FAKE_NODE_NAME])
    finally:
        down = subprocess.run(
            [*command, "down", *common], capture_output=True, text=True, env=env, timeout=120
        )
    assert down.returncode == 0, down.stderr
    assert not workdir.exists()
    for component, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or not _runs(pid, component), component


def _runs(pid: int, component: str) -> bool:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(component.encode())
        )
    except OSError:
        return False
