"""The platform on a real node: pods as containers under a real kubelet (tests/node/nodeenv.py).

`helm install` of charts/kvscale (the operator runs in-cluster from the chart's image), an
InferenceService with two replicas and its router, the official `openai` client through
`kubectl port-forward` to its Service, prefix routing on the node's IPv6-first pod network,
`kubectl exec` into a server, the restricted security context enforced by runc, a rolling update
under load, and deletion down to the last container; then the node itself is stopped and must
leave nothing on the machine. `make test-node`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from metrics_text import samples
from nodeenv import (
    NODE_NAME,
    POD_CIDR,
    POD_CIDR6,
    NodeEnv,
    leftovers,
    node_image,
    start_node_env,
    stop_node_env,
)
from prefix_hits import assert_predicted_hits_counted

from kvscale.base_urls import base_url
from kvscale.metric_names import ROUTER_FALLBACKS
from kvscale.operator.children.labels import headless_service_name
from kvscale.processes import free_port, wait_until

pytestmark = [pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "kvscale"
RELEASE = "kvscale"
SYSTEM = "kvscale-system"
WORKLOADS = "team-node"
NAME = "chat"
MODEL = "smollm2-135m-instruct"
SERVER_SELECTOR = f"serving.kvscale.io/inferenceservice={NAME}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeEnv]:
    env = start_node_env(tmp_path_factory.mktemp("node-logs"))
    print(f"node started: {json.dumps({k: round(v, 1) for k, v in env.timings.items()})}")
    try:
        yield env
    finally:
        t0 = time.monotonic()
        stop_node_env(env)
        print(f"node stopped in {time.monotonic() - t0:.1f}s: "
              f"{json.dumps({k: round(v, 1) for k, v in env.timings.items() if k.startswith('stop')})}")
    # Checked after every test of the module: a stopped node leaves nothing on the machine.
    assert leftovers() == []


def helm(env: NodeEnv, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    home = env.logs / "helm"
    return subprocess.run(
        [str(env.k8s_bins / "helm"), *args, f"--kubeconfig={env.kubeconfig}"],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, "HELM_CONFIG_HOME": str(home / "config"),
             "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")})


def diagnosis(env: NodeEnv) -> str:
    pods = env.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    events = env.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout
    logs = []
    for ns in (SYSTEM, WORKLOADS):
        for pod in env.kubectl("get", "pods", "-n", ns, "-o", "name", check=False).stdout.split():
            tail = env.kubectl("logs", "-n", ns, pod, "--all-containers", "--tail=15",
                               check=False)
            logs.append(f"--- {ns}/{pod}\n{tail.stdout}{tail.stderr}")
    return (f"{pods}\n{events[-4000:]}\n" + "\n".join(logs)
            + f"\n--- kubelet\n{env.log_tail('kubelet', 15)}")


def inference_service(max_num_seqs: int) -> dict:
    return {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": WORKLOADS},
        "spec": {"model": {"uri": f"bundled://{MODEL}"}, "replicas": 2,
                 # CPU only (the node has no GPU) and small requests: two cores run everything.
                 "resources": {"gpus": 0, "cpu": "200m", "memory": "2Gi"},
                 # The kernel enforces the 2Gi limit here: the operator sizes a CPU server's KV
                 # pool from it, both processes of `kvscale serve` counted (operator/server_memory.py;
                 # a fixed 2 GiB, then a quarter of the limit as if the core were alone: OOMKilled).
                 "engine": {"maxModelLen": 1024, "maxNumSeqs": max_num_seqs, "dtype": "float32"},
                 "router": {"replicas": 1, "resources": {"cpu": "100m", "memory": "512Mi"}}},
    }


def ready(env: NodeEnv) -> bool:
    status = env.kubectl_json("get", "kvis", NAME, "-n", WORKLOADS).get("status") or {}
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", []))


def fully_ready(env: NodeEnv) -> bool:
    """Ready says one server serves; the tests want both servers and every other container up
    (the second server may still be loading its model when the first makes it Ready)."""
    if not ready(env):
        return False
    pods = env.kubectl_json("get", "pods", "-A")["items"]
    return len(pods) == 5 and all(
        c.get("ready") for p in pods for c in (p.get("status") or {}).get("containerStatuses") or [{}])


class PortForward:
    """`kubectl port-forward` to a Service, as the chart's NOTES tell a user to run it."""

    def __init__(self, env: NodeEnv, target: str, port: int) -> None:
        self.local = free_port()
        self.proc = subprocess.Popen(
            [str(env.k8s_bins / "kubectl"), f"--kubeconfig={env.kubeconfig}", "port-forward",
             "-n", WORKLOADS, "--address", "127.0.0.1", target, f"{self.local}:{port}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        assert first.startswith("Forwarding from"), first + self.proc.stdout.read()
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.local}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def platform(node: NodeEnv) -> NodeEnv:
    """The chart installed and the InferenceService Ready (the tests below run in file order)."""
    env = node
    t0 = time.monotonic()
    repository, tag = node_image("redis").rsplit(":", 1)
    installed = helm(env, "install", RELEASE, str(CHART), "--namespace", SYSTEM, "--create-namespace",
                     "--set", "operator.replicas=1",
                     "--set", f"images.redis.repository={repository}",
                     "--set", f"images.redis.tag={tag}",
                     "--wait", "--timeout", "5m")
    assert installed.returncode == 0, installed.stderr + diagnosis(env)
    TIMINGS["helm install"] = time.monotonic() - t0
    env.kubectl("create", "namespace", WORKLOADS)
    t0 = time.monotonic()
    env.apply(inference_service(max_num_seqs=8))
    try:
        wait_until(lambda: fully_ready(env), 600, interval=2.0, what=f"{NAME} Ready, every container up")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{diagnosis(env)}") from None
    TIMINGS["InferenceService Ready"] = time.monotonic() - t0
    return env


TIMINGS: dict[str, float] = {}


def server_pods(env: NodeEnv) -> list[dict]:
    return list(env.kubectl_json("get", "pods", "-n", WORKLOADS, "-l", SERVER_SELECTOR)["items"])


def test_every_pod_is_a_container_on_the_node(platform: NodeEnv) -> None:
    pods = platform.kubectl_json("get", "pods", "-A")["items"]
    # The operator, two servers, the router and Redis.
    assert len(pods) == 5, [p["metadata"]["name"] for p in pods]
    assert len(server_pods(platform)) == 2
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        # IPv6 first (what a single-stack IPv6 cluster gives every pod), IPv4 second.
        assert [ipaddress.ip_address(ip["ip"]) in ipaddress.ip_network(cidr)
                for ip, cidr in zip(pod["status"]["podIPs"], (POD_CIDR6, POD_CIDR), strict=True)
                ] == [True, True], pod["status"]["podIPs"]
        assert pod["status"]["podIP"] == pod["status"]["podIPs"][0]["ip"]
        for status in pod["status"]["containerStatuses"]:
            assert status["ready"] and status["containerID"].startswith("containerd://")
    # Each container the API reports is a task runc runs (exited ones of replaced pods may
    # linger until the kubelet's garbage collection, so no exact count).
    tasks = dict(line.split()[0::2] for line in platform.ctr("tasks", "ls").stdout.splitlines()[1:])
    for pod in pods:
        for status in pod["status"]["containerStatuses"]:
            assert tasks.get(status["containerID"].removeprefix("containerd://")) == "RUNNING", tasks


def test_openai_client_through_kubectl_port_forward(platform: NodeEnv) -> None:
    forward = PortForward(platform, f"svc/{NAME}", 80)
    try:
        api = client(forward.url)
        try:
            models = [m.id for m in api.models.list()]
        except openai.APIConnectionError as exc:
            raise AssertionError(
                f"port-forward reached no listener ({exc!r}); kubectl port-forward dials "
                f"127.0.0.1 inside the pod, so a pod bound only to its pod IP is unreachable:\n"
                + "".join(forward.lines[-5:])) from None
        assert MODEL in models
        completion = api.completions.create(model=MODEL, prompt="The capital of France is",
                                            max_tokens=8, temperature=0)
        assert completion.choices[0].text and completion.usage is not None
        assert completion.usage.completion_tokens == 8
        chat = api.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Say hello."}])
        assert chat.choices[0].message.content
        pieces = [chunk.choices[0].text for chunk in api.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
            if chunk.choices]
        assert len(pieces) >= 2 and "".join(pieces)
    finally:
        forward.close()


LONG_PROMPT = "Inventory of the lighthouse: " + " ".join(
    f"lamp {n} burned {n * 5 % 11} hours on {('oil', 'gas', 'wax')[n % 3]};" for n in range(40))
BLOCK_SIZE = 16


def test_prefix_routing_on_the_ipv6_pod_network(platform: NodeEnv) -> None:
    """Each server advertises its IPv6 pod address in its heartbeats and KV events; the router
    finds the same replica in the EndpointSlice (an IPv6 one: the Service's family is the
    cluster's first). Only when the two spellings of the URL agree does the router's index
    predict the hits the server then counts."""
    env = platform
    server_urls = []
    for pod in server_pods(env):
        assert ipaddress.ip_address(pod["status"]["podIP"]).version == 6
        port = next(p["containerPort"] for c in pod["spec"]["containers"] if c["name"] == "server"
                    for p in c["ports"] if p["name"] == "http")
        server_urls.append(base_url(pod["status"]["podIP"], port))
    # The servers' headless Service, which the router watches.
    slices = env.kubectl_json("get", "endpointslices", "-n", WORKLOADS, "-l",
                              f"kubernetes.io/service-name={headless_service_name(NAME)}")["items"]
    assert {s["addressType"] for s in slices} == {"IPv6"}, slices
    service = env.kubectl_json("get", "service", NAME, "-n", WORKLOADS)
    assert ipaddress.ip_address(service["spec"]["clusterIP"]).version == 6
    router = base_url(service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"])

    # From the node, straight to each pod's IPv6 address.
    assert_predicted_hits_counted(client(router), MODEL, LONG_PROMPT, server_urls, block_size=BLOCK_SIZE,
                                  settle_s=2.0, diagnosis=lambda: diagnosis(env))
    fallbacks = samples(httpx.get(f"{router}/metrics", timeout=10).text, ROUTER_FALLBACKS.series)
    assert fallbacks.get('{reason="no_tokenizer"}', 0.0) == 0.0, fallbacks


def test_kubectl_exec_sees_the_restricted_context_enforced(platform: NodeEnv) -> None:
    pod = server_pods(platform)[0]["metadata"]["name"]

    def sh(script: str) -> subprocess.CompletedProcess[str]:
        return platform.kubectl("exec", "-n", WORKLOADS, pod, "-c", "server", "--", "sh", "-c",
                                script, check=False)

    uid = sh("id -u")
    assert uid.returncode == 0, uid.stderr
    assert int(uid.stdout.strip()) != 0
    written = sh("echo x > /kvscale-root-write-test")
    assert written.returncode != 0 and "Read-only file system" in written.stderr, written
    status = sh("cat /proc/self/status").stdout
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M), status
    assert re.search(r"^CapEff:\s+0+$", status, re.M), status
    # Writable only where the pod spec says so (an emptyDir on /tmp).
    assert sh("echo x > /tmp/kvscale-write-test && cat /tmp/kvscale-write-test").stdout == "x\n"


def test_rolling_update_fails_no_request(platform: NodeEnv) -> None:
    env = platform
    # As a client inside the cluster: the router's Service, through kube-proxy's rules.
    service = env.kubectl_json("get", "service", NAME, "-n", WORKLOADS)
    url = base_url(service["spec"]["clusterIP"], service["spec"]["ports"][0]["port"])
    failures: list[str] = []
    served = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal served
        loop_client = client(url)
        while not stop.is_set():
            try:
                loop_client.completions.create(model=MODEL, prompt="Count: one, two,",
                                               max_tokens=4, temperature=0)
                served += 1
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    old = {p["metadata"]["name"] for p in server_pods(env)}
    t0 = time.monotonic()
    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        wait_until(lambda: served > 0 or failures, 120, interval=0.5, what="the first request")
        env.apply(inference_service(max_num_seqs=6))

        def rolled() -> bool:
            pods = server_pods(env)
            return (len(pods) == 2 and not {p["metadata"]["name"] for p in pods} & old
                    and all(c["ready"] for p in pods for c in p["status"].get("containerStatuses", []))
                    and ready(env))

        try:
            wait_until(rolled, 600, interval=2.0, what="the servers rolled over")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnosis(env)}") from None
        before = served
        wait_until(lambda: served >= before + 3, 120, interval=0.5, what="requests to the new pods")
    finally:
        stop.set()
        loader.join(150)
    TIMINGS["rolling update"] = time.monotonic() - t0
    assert failures == [], failures[:5]


def test_deletion_leaves_nothing_behind(platform: NodeEnv) -> None:
    env = platform
    t0 = time.monotonic()
    env.kubectl("delete", "kvis", NAME, "-n", WORKLOADS, "--wait=true", "--timeout=180s")
    uninstalled = helm(env, "uninstall", RELEASE, "--namespace", SYSTEM, "--wait", "--timeout", "3m")
    assert uninstalled.returncode == 0, uninstalled.stderr
    wait_until(lambda: not env.kubectl_json("get", "pods", "-A")["items"], 180, interval=1.0,
               what="every pod gone")
    # The kubelet removed every container and sandbox, not only the API objects.
    wait_until(lambda: not env.ctr("containers", "ls", "-q").stdout.split(), 120, interval=1.0,
               what="every container gone from containerd")
    assert not env.ctr("tasks", "ls", "-q").stdout.split()
    assert not env.kubectl_json("get", "deployments,services,secrets", "-n", WORKLOADS)["items"]
    TIMINGS["deletion"] = time.monotonic() - t0
    print(f"platform timings: {json.dumps({k: round(v, 1) for k, v in TIMINGS.items()})}")
