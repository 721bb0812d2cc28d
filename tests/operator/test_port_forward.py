"""`kubectl port-forward` to every pod the operator and its manifests make, emulated on the
process runtime: a dial to 127.0.0.1 (and ::1) inside the pod's own network namespace, as the
kubelet's port-forward does on a real node. A pod that binds only its pod IP refuses it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from testenv import kwok_toleration, ready_pods

from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
OPERATOR_NAMESPACE = "kvscale-system"
READY_TIMEOUT_S = 420.0  # a model load on a shared 2-core machine
# Run inside a pod's namespace: each (host, port, request) -> the first line of the answer.
DIAL = """
import json, socket, sys
out = {}
for host, port, request in json.loads(sys.argv[1]):
    key = f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(request.encode())
            data = b""
            while b"\\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
            out[key] = data.decode(errors="replace").splitlines()[0] if data else ""
    except OSError as exc:
        out[key] = f"error: {exc!r}"
print(json.dumps(out))
"""


def http_get(path: str) -> str:
    return f"GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n"


def port_forward(cluster: Any, namespace: str, pod: str, port: int, request: str) -> dict[str, str]:
    """What `kubectl port-forward pod/POD PORT` would get: localhost, inside the pod."""
    targets = [["127.0.0.1", port, request], ["::1", port, request]]
    argv = [*cluster.runtime.enter(namespace, pod), sys.executable, "-c", DIAL, json.dumps(targets)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def served(process_cluster) -> Iterator[tuple[Any, str]]:
    """The operator from deploy/*.yaml, and one InferenceService with its router and Redis."""
    env = process_cluster.env
    env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    env.kubectl("apply", "-f", str(REPO_ROOT / "deploy" / "operator.yaml"))
    namespace = f"pf-{uuid.uuid4().hex[:6]}"
    env.kubectl("create", "namespace", namespace)
    service = {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": namespace},
        "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"}, "replicas": 1,
                 "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                 "engine": {"maxModelLen": 1024, "maxNumSeqs": 4, "dtype": "float32"},
                 "router": {"replicas": 1},
                 "tolerations": [kwok_toleration()]},
    }
    env.kubectl("apply", "-f", "-", input=json.dumps(service))

    def ready() -> bool:
        status = env.kubectl_json("get", "inferenceservice", "chat", "-n", namespace).get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return (conditions.get("Ready") == "True" and status.get("readyReplicas") == 1
                and (status.get("router") or {}).get("readyReplicas", 0) >= 1
                and bool(ready_pods(process_cluster.env, namespace, "app.kubernetes.io/component=kv-index")))

    try:
        wait_until(ready, READY_TIMEOUT_S, interval=1.0, what="chat Ready with its router and Redis")
        yield process_cluster, namespace
    finally:
        env.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def only_pod(cluster: Any, namespace: str, selector: str) -> str:
    pods = ready_pods(cluster.env, namespace, selector)
    assert pods, f"no ready pod for {selector} in {namespace}"
    return pods[0]["metadata"]["name"]


def test_the_server_answers_on_localhost_inside_its_pod(served) -> None:
    cluster, namespace = served
    pod = only_pod(cluster, namespace, "serving.kvscale.io/inferenceservice=chat")
    answers = port_forward(cluster, namespace, pod, 8000, http_get("/health"))
    assert set(answers.values()) == {"HTTP/1.1 200 OK"}, answers


def test_the_router_answers_on_localhost_inside_its_pod(served) -> None:
    cluster, namespace = served
    pod = only_pod(cluster, namespace, "serving.kvscale.io/router=chat")
    answers = port_forward(cluster, namespace, pod, 8080, http_get("/health"))
    assert set(answers.values()) == {"HTTP/1.1 200 OK"}, answers


def test_redis_answers_on_localhost_inside_its_pod(served) -> None:
    cluster, namespace = served
    pod = only_pod(cluster, namespace, "app.kubernetes.io/component=kv-index")
    answers = port_forward(cluster, namespace, pod, 6379, "PING\r\n")
    # It asks for the password, which is Redis answering (not a refused connection).
    assert all(a.startswith("-NOAUTH") for a in answers.values()), answers


def test_the_operator_metrics_answer_on_localhost_inside_its_pod(served) -> None:
    cluster, _ = served
    pod = only_pod(cluster, OPERATOR_NAMESPACE, "app.kubernetes.io/component=operator")
    answers = port_forward(cluster, OPERATOR_NAMESPACE, pod, 8081, http_get("/metrics"))
    assert all(a.startswith("HTTP/1.") and " 200 " in a for a in answers.values()), answers
