"""The whole platform on Kubernetes, every pod a real process.

`kubectl apply` of the CRD, RBAC and operator manifests, then of one InferenceService: the
operator (itself two pods, leader-elected, under its ServiceAccount), the router pods, Redis and
the `kvscale serve` pods all run as processes through tests/cluster/kubelet.py on a real
kube-apiserver, and the official `openai` client talks to a router pod's IP.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from operator_helpers import install_operator, platform_inference_service
from testenv import ready_pods

from kvscale.metric_names import PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES
from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "team-a"
MODEL = "smollm2-135m-instruct"
READY_TIMEOUT_S = 420.0  # two model loads on a shared 2-core machine


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def inference_service(name: str, replicas: int, **spec: Any) -> dict[str, Any]:
    return platform_inference_service(name, NAMESPACE, replicas, **spec)


@dataclass
class Platform:
    cluster: Any  # tests/conftest.py's ProcessCluster

    @property
    def env(self):
        return self.cluster.env

    @property
    def runtime(self):
        return self.cluster.runtime

    def get(self, *args: str) -> dict[str, Any]:
        return self.env.kubectl_json("get", *args)

    def pods(self, selector: str) -> list[dict[str, Any]]:
        return self.get("pods", "-n", NAMESPACE, "-l", selector)["items"]

    def ready_pods(self, selector: str) -> list[dict[str, Any]]:
        return ready_pods(self.env, NAMESPACE, selector)

    def server_pods(self, name: str) -> list[dict[str, Any]]:
        return self.ready_pods(f"serving.kvscale.io/inferenceservice={name}")

    def router_url(self, name: str) -> str:
        routers = self.ready_pods(f"serving.kvscale.io/router={name}")
        assert routers, "no ready router pod"
        return f"http://{routers[0]['status']['podIP']}:8080"

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router_url(name) + "/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def wait_whole(self, name: str, replicas: int) -> None:
        """Every replica's pod Ready, as well as the status saying so (which may lag a crash)."""
        wait_until(lambda: len(self.server_pods(name)) == replicas, READY_TIMEOUT_S, interval=1.0,
                   what=f"{replicas} Ready {name} pods")
        self.wait_ready(name, replicas)

    def wait_ready(self, name: str, replicas: int, timeout: float = READY_TIMEOUT_S) -> dict[str, Any]:
        def ready() -> bool:
            status = self.get("inferenceservice", name, "-n", NAMESPACE).get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            return (conditions.get("Ready") == "True" and status.get("readyReplicas") == replicas
                    and (status.get("router") or {}).get("readyReplicas", 0) >= 1)

        try:
            wait_until(ready, timeout, interval=1.0, what=f"{name} Ready with {replicas} replicas")
        except TimeoutError:
            pods = self.get("pods", "-n", NAMESPACE)["items"]
            logs = "\n".join(f"--- {p['metadata']['name']}\n"
                             + self.runtime.log_tail(NAMESPACE, p["metadata"]["name"])
                             for p in pods if (NAMESPACE, p["metadata"]["name"]) in self.runtime.workers)
            status = self.get("inferenceservice", name, "-n", NAMESPACE).get("status")
            raise AssertionError(f"not ready: {json.dumps(status)}\n{logs}") from None
        return self.get("inferenceservice", name, "-n", NAMESPACE)


@pytest.fixture(scope="module")
def platform(process_cluster) -> Iterator[Platform]:
    env = process_cluster.env
    install_operator(env, NAMESPACE)
    platform = Platform(process_cluster)
    yield platform
    env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


@dataclass
class Load:
    """Clients sending completions (half of them streaming) until stopped; every outcome kept."""

    client: openai.OpenAI
    prompts: list[str]
    workers: int = 4
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    cut_streams: int = 0  # failed after the first chunk: allowed when a replica dies mid-way
    replicas: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, index: int) -> None:
        prompt = self.prompts[index % len(self.prompts)]
        stream = index % 2 == 1
        started = False
        try:
            if stream:
                with self.client.completions.with_streaming_response.create(
                        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True) as response:
                    replica = response.headers.get("x-kvscale-replica", "?")
                    chunks = 0
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            started = True
                            chunks += 1
                    assert chunks > 0, "a stream with no chunk"
            else:
                raw = self.client.completions.with_raw_response.create(
                    model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
                replica = raw.headers.get("x-kvscale-replica", "?")
                assert raw.parse().choices[0].text is not None
            with self._lock:
                self.ok += 1
                self.replicas[replica] = self.replicas.get(replica, 0) + 1
        except Exception as exc:  # every failure is counted, none hidden
            with self._lock:
                if started:
                    self.cut_streams += 1
                else:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def _run(self, worker: int) -> None:
        index = worker
        while not self._stop.is_set():
            self._one(index)
            index += self.workers

    def start(self) -> Load:
        self._threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Load:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        return self


PREFIXES = [
    f"Document {n}: " + " ".join(f"{word}{n}" for word in (
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
        "sigma tau upsilon phi chi psi omega").split() * 3)
    for n in range(3)
]


def test_one_inference_service_serves_through_its_router(platform: Platform) -> None:
    env = platform.env
    env.kubectl("apply", "-f", "-", input=json.dumps(inference_service("chat", 2)))
    resource = platform.wait_ready("chat", 2)
    status = resource["status"]
    # The URL names the service's own Service, which selects the router pods.
    assert status["url"] == f"http://chat.{NAMESPACE}.svc.cluster.local"
    service = platform.get("service", "chat", "-n", NAMESPACE)
    assert service["spec"]["selector"] == {"serving.kvscale.io/router": "chat"}
    assert status["router"]["redis"] == "internal"
    for kind, child in (("deployment", "chat-router"), ("deployment", "chat-redis"),
                        ("service", "chat-redis"), ("secret", "chat-redis"),
                        ("poddisruptionbudget", "chat-router"), ("serviceaccount", "chat-router")):
        owners = platform.get(kind, child, "-n", NAMESPACE)["metadata"]["ownerReferences"]
        assert owners[0]["kind"] == "InferenceService" and owners[0]["name"] == "chat"
    # Ready needs one serving router; the second of the Deployment's two may still be starting.
    wait_until(lambda: len(platform.ready_pods("serving.kvscale.io/router=chat")) == 2,
               READY_TIMEOUT_S, interval=1.0, what="2 Ready router pods")

    client = platform.client("chat")
    assert [m.id for m in client.models.list().data] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text.strip()
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                          messages=[{"role": "user", "content": "Say hi"}])
    assert chat.choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count to three"}]) if chunk.choices]
    assert "".join(pieces).strip()
    missing = client.completions.with_raw_response
    with pytest.raises(openai.NotFoundError):
        missing.create(model="no-such-model", prompt="x", max_tokens=1)

    # The servers publish to the operator's Redis: their heartbeats name them by pod name.
    wait_named_by_heartbeats(platform, "chat")


def wait_named_by_heartbeats(platform: Platform, name: str) -> None:
    """Wait until every router reads Redis and knows each healthy server by its pod name.

    Until a server's first heartbeat is read, a router knows it by address only; the heartbeats
    come on their own clock after Redis is up (a loaded machine can delay them, or time a Redis
    call out so that a router says "down" until its next poll succeeds)."""
    pod_names = {p["metadata"]["name"] for p in platform.server_pods(name)}
    routers = router_urls(platform, name)

    seen: list[list[tuple[str, set[str]]]] = []

    def named() -> bool:
        views = [(view["redis"], {r["id"] for r in view["replicas"] if r["healthy"]})
                 for view in router_views(platform, name, routers)]
        seen[:] = [views]
        return all(redis == "up" and ids == pod_names for redis, ids in views)

    try:
        wait_until(named, 60, interval=0.2, what="the routers naming the servers")
    except TimeoutError as exc:
        raise AssertionError(f"routers' (redis, healthy ids) {seen}, servers {sorted(pod_names)}") from exc


def test_prefix_affinity_through_the_cluster(platform: Platform) -> None:
    client = platform.client("chat")
    servers = platform.server_pods("chat")
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in servers}
    # The routers name each replica as its KV events do before any placement is counted.
    wait_named_by_heartbeats(platform, "chat")

    def counters() -> dict[str, tuple[float, float]]:
        out = {}
        for pod, ip in ips.items():
            text = httpx.get(f"http://{ip}:8000/metrics", timeout=5).text
            out[pod] = (metric_value(text, PREFIX_CACHE_HITS.series), metric_value(text, PREFIX_CACHE_QUERIES.series))
        return out

    before = counters()
    placed: dict[int, set[str]] = {}
    predicted = 0
    for round_ in range(3):
        for n, prefix in enumerate(PREFIXES):
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=f"{prefix} Question {round_}: what comes next?", max_tokens=2,
                temperature=0)
            placed.setdefault(n, set()).add(raw.headers["x-kvscale-replica"])
            predicted += int(raw.headers["x-kvscale-predicted-hit-tokens"])
        time.sleep(1.5)  # KV events reach Redis and the routers between rounds
    after = counters()
    hits = {pod: after[pod][0] - before[pod][0] for pod in ips}
    # Each prefix stays on the replica that holds it, and that replica's own counters say so.
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    for n, replicas in placed.items():
        (holder,) = replicas
        assert hits[holder] >= 2 * 64, (n, holder, hits)
    # What the router predicted is what the replicas found cached (block-granular on both sides).
    observed = sum(hits.values())
    assert observed > 0 and abs(predicted - observed) <= 16 * len(PREFIXES), (predicted, observed)


LOAD_PROMPTS = [f"{prefix} Summarise document {n % 3} in one line." for n, prefix in enumerate(PREFIXES * 2)]


def router_urls(platform: Platform, name: str) -> list[str]:
    return [f"http://{p['status']['podIP']}:8080" for p in platform.ready_pods(f"serving.kvscale.io/router={name}")]


def router_views(platform: Platform, name: str, urls: list[str] | None = None) -> list[dict[str, Any]]:
    """Every router's /health. Pass ``urls`` when timing the routers: listing the pods runs
    kubectl, whose start-up would count against them."""
    return [httpx.get(f"{url}/health", timeout=5).json() for url in urls or router_urls(platform, name)]


def router_metrics(platform: Platform, name: str) -> list[str]:
    return [httpx.get(f"http://{p['status']['podIP']}:8080/metrics", timeout=5).text
            for p in platform.ready_pods(f"serving.kvscale.io/router={name}")]


def test_a_crashed_server_is_dropped_at_once_and_used_again_once_ready(platform: Platform) -> None:
    servers = {p["metadata"]["name"] for p in platform.server_pods("chat")}
    routers = router_urls(platform, "chat")
    load = Load(platform.client("chat"), LOAD_PROMPTS).start()
    try:
        # The victim is a replica the load is using (prefix affinity may send it all to one).
        wait_until(lambda: any(load.replicas.get(s, 0) >= 2 for s in servers), 120, interval=0.2,
                   what="traffic on a replica")
        victim = max(servers, key=lambda s: load.replicas.get(s, 0))
        platform.runtime.kill(NAMESPACE, victim)  # SIGKILL: a crash
        wait_until(lambda: victim not in {p["metadata"]["name"] for p in platform.server_pods("chat")},
                   15, interval=0.05, what=f"{victim} NotReady in the API")
        not_ready_at = time.monotonic()

        def dropped() -> bool:
            return all(all(r["id"] != victim or not r["healthy"] for r in view["replicas"])
                       for view in router_views(platform, "chat", routers))

        wait_until(dropped, 5, interval=0.05, what=f"routers to stop using {victim}")
        assert time.monotonic() - not_ready_at <= 1.0
        # Its blocks left every router's index (the gauge goes with them).
        wait_until(lambda: all(f'replica="{victim}"' not in text.split("kvscale_router_index_blocks")[-1]
                               for text in router_metrics(platform, "chat")),
                   10, interval=0.2, what=f"{victim}'s blocks out of the index")
        # The kubelet restarts the container; once Ready again, it gets traffic again. (The load's
        # prefixes are all cached on the survivor now, so fresh prompts show it.)
        wait_until(lambda: victim in {p["metadata"]["name"] for p in platform.server_pods("chat")},
                   READY_TIMEOUT_S, interval=0.5, what=f"{victim} Ready again")
        fresh = Load(platform.client("chat"), [f"New subject {n}: describe colour {n}." for n in range(40)])
        fresh.start()
        try:
            wait_until(lambda: fresh.replicas.get(victim, 0) > 0, 120, interval=0.2,
                       what=f"traffic on the restarted {victim}")
        finally:
            fresh.stop()
        assert fresh.failures == [], fresh.failures
    finally:
        load.stop()
    assert load.ok > 0 and load.failures == [], load.failures
    restarts = platform.get("pod", victim, "-n", NAMESPACE)["status"]["containerStatuses"][0]
    assert restarts["restartCount"] == 1


def redis_client(platform: Platform, name: str):
    import base64

    import redis

    secret = platform.get("secret", f"{name}-redis", "-n", NAMESPACE)
    password = base64.b64decode(secret["data"]["password"]).decode()
    (pod,) = platform.ready_pods(f"serving.kvscale.io/redis={name}")
    return redis.Redis(host=pod["status"]["podIP"], port=6379, password=password, socket_timeout=5)


def test_redis_killed_and_restarted_under_load_fails_nothing(platform: Platform) -> None:
    from kvscale.kv_index_schema import REPLICAS_KEY, blocks_key

    # Whole again after the crash test, or a replica still restarting would join the index
    # later and never be among ``servers``.
    platform.wait_whole("chat", 2)
    redis_pod = platform.ready_pods("serving.kvscale.io/redis=chat")[0]["metadata"]["name"]
    servers = {p["metadata"]["name"] for p in platform.server_pods("chat")}
    load = Load(platform.client("chat"), LOAD_PROMPTS).start()
    try:
        wait_until(lambda: load.ok >= 4, 120, interval=0.2, what="load under way")
        # Affinity may leave a replica without cached blocks: those that hold some must again.
        client = redis_client(platform, "chat")
        holding = {s for s in servers if client.scard(blocks_key(s)) > 0}
        assert holding
        platform.runtime.kill(NAMESPACE, redis_pod)
        wait_until(lambda: any(view["redis"] == "down" for view in router_views(platform, "chat")),
                   20, interval=0.1, what="a router to see Redis down")
        ok_while_down = load.ok
        wait_until(lambda: all(view["redis"] == "up" for view in router_views(platform, "chat")),
                   60, interval=0.2, what="the routers to see Redis back")
        wait_until(lambda: load.ok > ok_while_down + 4, 120, interval=0.2, what="load after Redis is back")

        def resynced() -> bool:
            client = redis_client(platform, "chat")
            members = {m.decode() for m in client.zrange(REPLICAS_KEY, 0, -1)}
            return members == servers and all(client.scard(blocks_key(s)) > 0 for s in holding)

        # The restarted Redis is empty: the replicas write their whole block sets again.
        wait_until(resynced, 60, interval=0.5, what="the index back in the restarted Redis")
    finally:
        load.stop()
    assert load.ok > 0 and load.failures == [], load.failures


def test_scale_out_and_in_through_the_scale_subresource(platform: Platform) -> None:
    env = platform.env
    platform.wait_whole("chat", 2)
    before = {p["metadata"]["name"] for p in platform.server_pods("chat")}
    env.kubectl("scale", "inferenceservice/chat", "-n", NAMESPACE, "--replicas=3")
    platform.wait_ready("chat", 3)
    (new,) = {p["metadata"]["name"] for p in platform.server_pods("chat")} - before
    load = Load(platform.client("chat"), [f"Fresh topic {n}: tell me about the number {n}." for n in range(24)])
    load.start()
    try:
        wait_until(lambda: load.replicas.get(new, 0) >= 1, 120, interval=0.2, what=f"traffic on {new}")

        def costs() -> dict[str, int]:
            return {p["metadata"]["name"]: int((p["metadata"].get("annotations") or {}).get(
                "controller.kubernetes.io/pod-deletion-cost", "0"))
                for p in platform.server_pods("chat")}

        wait_until(lambda: len(costs()) == 3, 30, interval=0.5, what="three ready pods")
        costs_before = costs()
        env.kubectl("scale", "inferenceservice/chat", "-n", NAMESPACE, "--replicas=2")
        wait_until(lambda: len(platform.pods("serving.kvscale.io/inferenceservice=chat")) == 2, 120,
                   interval=0.5, what="one pod removed")
        (removed,) = set(costs_before) - {p["metadata"]["name"] for p in platform.pods(
            "serving.kvscale.io/inferenceservice=chat")}
        assert costs_before[removed] == min(costs_before.values()), (removed, costs_before)
        time.sleep(2)
    finally:
        load.stop()
    assert load.ok > 0 and load.failures == [], load.failures
    platform.wait_ready("chat", 2)


def test_deleting_the_inference_service_leaves_nothing(platform: Platform) -> None:
    env = platform.env
    pods_before = set(platform.runtime.pids())
    assert any(ns == NAMESPACE for ns, _ in pods_before)
    env.kubectl("delete", "inferenceservice", "chat", "-n", NAMESPACE, "--wait=true", "--timeout=120s")

    def gone() -> bool:
        left = [p for p in env.kubectl_json("get", "all,secrets,pdb,serviceaccounts,roles,rolebindings",
                                            "-n", NAMESPACE)["items"]
                if p["kind"] != "ServiceAccount" or p["metadata"]["name"] != "default"]
        left = [o for o in left if not (o["kind"] == "Secret" and o["metadata"]["name"].startswith("default-token"))]
        return not left and not any(ns == NAMESPACE for ns, _ in platform.runtime.pids())

    wait_until(gone, 120, interval=1.0, what="every child object and process of chat gone")
