"""`helm install`, an InferenceService, `helm test`: on the process runtime, where every pod of
the release and of the platform it creates runs as a real process (tests/cluster/kubelet.py).

The operator comes from the chart (its Deployment, ServiceAccount and RBAC, in-cluster config
from the pod's token), reconciles the InferenceService into servers, router and Redis, and the
chart's `helm test` pods list the models and complete through the router's Service, then check a
server's /metrics: the hooks run exactly as a cluster would run them.
"""

from __future__ import annotations

import json

import pytest
from chart_helpers import CHART, Helm
from testenv import kwok_toleration

from kvscale.processes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

RELEASE = "kvs-platform"
NAMESPACE = "kvscale-platform"
WORKLOADS = "team-helm"
MODEL = "smollm2-135m-instruct"


def test_helm_install_serves_and_helm_test_passes(helm, process_cluster) -> None:
    env, runtime = process_cluster.env, process_cluster.runtime
    chelm = Helm(helm.binary, env.kubeconfig)
    env.kubectl("create", "namespace", WORKLOADS)

    def diagnosis() -> str:
        pods = env.kubectl_json("get", "pods", "-A")["items"]
        return "\n".join(
            f"--- {p['metadata']['namespace']}/{p['metadata']['name']} "
            f"{(p.get('status') or {}).get('phase')}\n"
            + (runtime.log_tail(p["metadata"]["namespace"], p["metadata"]["name"], 15)
               if (p["metadata"]["namespace"], p["metadata"]["name"]) in runtime.workers else "")
            for p in pods)

    installed = chelm.run("install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                          "--create-namespace", "--set", "operator.replicas=1",
                          "--set", "tests.inferenceService=chat", "--set", f"tests.namespace={WORKLOADS}",
                          "--wait", "--timeout", "4m", check=False)
    assert installed.returncode == 0, installed.stderr + diagnosis()
    try:
        resource = {
            "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "chat", "namespace": WORKLOADS},
            "spec": {"model": {"uri": f"bundled://{MODEL}"}, "replicas": 1,
                     "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                     "engine": {"maxModelLen": 1024, "maxNumSeqs": 8, "dtype": "float32"},
                     "router": {"replicas": 1},
                     "tolerations": [kwok_toleration()]},
        }
        env.kubectl("apply", "-f", "-", input=json.dumps(resource))

        def ready() -> bool:
            status = env.kubectl_json("get", "kvis", "chat", "-n", WORKLOADS).get("status") or {}
            return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))

        try:
            wait_until(ready, 420, interval=1.0, what="chat Ready (operator from the chart)")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnosis()}") from None
        tested = chelm.run("test", RELEASE, "--namespace", NAMESPACE, "--timeout", "4m", check=False)
        assert tested.returncode == 0, tested.stdout + tested.stderr + diagnosis()
        # Both hook pods (models + completion through the router; a server's metrics) passed.
        assert tested.stdout.count("Phase:          Succeeded") == 2, tested.stdout
    finally:
        env.kubectl("delete", "kvis", "chat", "-n", WORKLOADS, "--wait=true", "--timeout=120s", check=False)
        chelm.run("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "3m", check=False)
        env.kubectl("delete", "namespace", WORKLOADS, "--wait=false", check=False)
    wait_until(lambda: not any(ns in (NAMESPACE, WORKLOADS) for ns, _ in runtime.pids()), 120,
               interval=1.0, what="every process of the release and its InferenceService gone")
