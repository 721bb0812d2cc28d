"""The process runtime's pod network behaves like a node's: each pod in a network namespace of its
own, reached on its pod IP from the host and from other pods, on 127.0.0.1 and ::1 from inside
(what `kubectl port-forward` dials), Services reachable from pods, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubelet import KubeletRuntime, start_runtime
from pod_network import PodNetwork, link_names, netns_names
from testenv import CPU_NODE_NAME, FAKE_NODE_NAME, K8sEnv, ready_pods, start_env, stop_env

from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

PORT = 8080
# Every pod of the Deployment listens on the same port on every address (IPv4 and IPv6) and
# answers GET with its own name: who answered tells which namespace a connection reached.
ECHO_SERVER = f"""
import http.server, os, socket
class Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["HOSTNAME"].encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
Server(("::", {PORT}), Echo).serve_forever()
"""
# Run inside a namespace with nsenter: GET each URL, print what answered (or the error).
FETCH = """
import json, ssl, sys, urllib.request
out = {}
for url in sys.argv[1:]:
    try:
        context = ssl._create_unverified_context()
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            out[url] = response.read().decode()
    except Exception as exc:
        out[url] = f"error: {exc!r}"
print(json.dumps(out))
"""


@dataclass
class Cluster:
    env: K8sEnv
    runtime: KubeletRuntime
    namespace: str
    stopped: bool = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.runtime.stop()
            stop_env(self.env, keep_logs=True)

    def fetch(self, pod: str, *urls: str) -> dict[str, str]:
        """GET `urls` from inside `pod`'s network namespace."""
        argv = [*self.runtime.enter(self.namespace, pod), sys.executable, "-c", FETCH, *urls]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def echo_deployment(namespace: str, replicas: int) -> dict:
    labels = {"app": "echo"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "echo", "namespace": namespace},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": CPU_NODE_NAME},
                     "containers": [{
                         "name": "echo", "image": "kvscale:test",
                         "command": ["python", "-c", ECHO_SERVER],
                         "ports": [{"name": "http", "containerPort": PORT}],
                         "readinessProbe": {"httpGet": {"path": "/", "port": "http"},
                                            "periodSeconds": 1},
                     }]}}},
    }


def echo_service(namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": namespace},
            "spec": {"selector": {"app": "echo"},
                     "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


@pytest.fixture(scope="module")
def cluster(k8s_bins: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("pod-network")
    env = start_env(workdir / "env", k8s_bins, process_pods=True)
    try:
        runtime = start_runtime(env, workdir / "kubelet", (FAKE_NODE_NAME, CPU_NODE_NAME))
    except BaseException:
        stop_env(env, keep_logs=True)
        raise
    namespace = f"net-{uuid.uuid4().hex[:6]}"
    cluster = Cluster(env, runtime, namespace)
    try:
        env.kubectl("create", "namespace", namespace)
        env.kubectl("apply", "-f", "-", input=json.dumps(echo_deployment(namespace, 2)))
        env.kubectl("apply", "-f", "-", input=json.dumps(echo_service(namespace)))
        yield cluster
    finally:
        cluster.stop()


def wait_for_two(cluster: Cluster) -> list[dict]:
    def echo_pods() -> list[dict]:
        return ready_pods(cluster.env, cluster.namespace, "app=echo")

    wait_until(lambda: len(echo_pods()) == 2, 120, interval=0.5, what="two echo pods Ready")
    return sorted(echo_pods(), key=lambda p: p["metadata"]["name"])


def test_the_service_cidr_is_outside_loopback(cluster: Cluster) -> None:
    """A pod's namespace reaches the host through its veth, which never carries 127/8."""
    for cidr in (cluster.env.service_cidr, cluster.env.pod_cidr):
        assert cidr.startswith("198.18."), cidr
    assert cluster.env.kubernetes_service_ip.startswith("198.18.")


def test_two_pods_on_one_port_each_in_its_namespace(cluster: Cluster) -> None:
    pods = wait_for_two(cluster)
    names = [p["metadata"]["name"] for p in pods]
    ips = [p["status"]["podIP"] for p in pods]
    assert len(set(ips)) == 2
    for name, pod_ip in zip(names, ips, strict=True):
        # From the host (tests, probes, kube-proxy): the pod IP, through the bridge.
        host_side = subprocess.run(
            [sys.executable, "-c", FETCH, f"http://{pod_ip}:{PORT}/"],
            capture_output=True, text=True, timeout=60, check=True)
        assert json.loads(host_side.stdout) == {f"http://{pod_ip}:{PORT}/": name}
        # `kubectl port-forward`: localhost inside the pod's own namespace, IPv4 and IPv6.
        inside = cluster.fetch(name, f"http://127.0.0.1:{PORT}/", f"http://[::1]:{PORT}/",
                               f"http://{pod_ip}:{PORT}/")
        assert set(inside.values()) == {name}, inside


def test_pods_reach_each_other_services_and_the_apiserver(cluster: Cluster) -> None:
    pods = wait_for_two(cluster)
    (first, second) = [p["metadata"]["name"] for p in pods]
    second_ip = pods[1]["status"]["podIP"]
    service = cluster.env.kubectl_json("get", "service", "echo", "-n", cluster.namespace)
    cluster_ip = service["spec"]["clusterIP"]
    assert cluster_ip.startswith("198.18.")

    def through_the_service() -> bool:
        answer = cluster.fetch(first, f"http://{cluster_ip}/")[f"http://{cluster_ip}/"]
        return answer in (first, second)

    # kube-proxy's emulation follows the EndpointSlices, a moment after the pods are Ready.
    wait_until(through_the_service, 60, interval=0.5, what="the Service answering from a pod")
    answers = cluster.fetch(
        first, f"http://{second_ip}:{PORT}/",
        f"https://{cluster.env.kubernetes_service_ip}/version")
    assert answers[f"http://{second_ip}:{PORT}/"] == second
    assert '"gitVersion"' in answers[f"https://{cluster.env.kubernetes_service_ip}/version"], answers
    # 127.0.0.1 is each pod's own: the first pod's loopback never reaches the second.
    assert cluster.fetch(first, f"http://127.0.0.1:{PORT}/")[f"http://127.0.0.1:{PORT}/"] == first


def test_a_deleted_pod_takes_its_namespace_along(cluster: Cluster) -> None:
    pods = wait_for_two(cluster)
    victim = pods[0]
    network: PodNetwork = cluster.runtime.network
    name = network.namespace_name(victim["status"]["podIP"])
    assert name in netns_names()
    cluster.env.kubectl("delete", "pod", victim["metadata"]["name"], "-n", cluster.namespace,
                        "--grace-period=1")
    wait_until(lambda: name not in netns_names(), 60, interval=0.5, what=f"{name} removed")
    assert network.veth_name(victim["status"]["podIP"]) not in link_names()
    wait_for_two(cluster)  # the Deployment's replacement, in a namespace of its own


def test_stopping_the_runtime_leaves_no_namespace_veth_or_bridge(cluster: Cluster) -> None:
    wait_for_two(cluster)
    network: PodNetwork = cluster.runtime.network
    before = network.leftovers()
    assert len(before["netns"]) == 2 and network.bridge in before["links"] and before["routes"]
    cluster.stop()
    assert network.leftovers() == {"netns": [], "links": [], "routes": []}
