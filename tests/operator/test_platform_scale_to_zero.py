"""Scale to and from zero on the whole platform, every pod a real process.

One InferenceService with `autoscaling.minReplicas: 0` and a short idle window, created at zero
replicas: its router is up, no server runs. The official openai client then sends, in turn:
200 requests at once (half streaming, chat and completions); sparse requests one idle window and
a half apart; requests while the operator is gone; requests while Redis is frozen. Every request
must be answered: the router holds them, raises the scale itself, and releases them to the first
ready replica.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from operator_helpers import install_operator, platform_inference_service
from testenv import ready_pods

from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "team-zero"
NAME = "idle"
MODEL = "smollm2-135m-instruct"
IDLE_WINDOW_S = 8
OPERATOR = ("-n", "kvscale-system", "deployment/kvscale-operator")


@dataclass
class Cluster:
    raw: Any  # tests/conftest.py's ProcessCluster

    def get(self, *args: str) -> dict[str, Any]:
        return self.raw.env.kubectl_json("get", *args)

    def kubectl(self, *args: str, **kwargs: Any) -> Any:
        return self.raw.env.kubectl(*args, **kwargs)

    def resource(self) -> dict[str, Any]:
        return self.get("inferenceservice", NAME, "-n", NAMESPACE)

    def ready_pods(self, selector: str) -> list[dict[str, Any]]:
        return ready_pods(self.raw.env, NAMESPACE, selector)

    def servers(self) -> list[dict[str, Any]]:
        return self.get("pods", "-n", NAMESPACE, "-l", f"serving.kvscale.io/inferenceservice={NAME}")["items"]

    def router_url(self) -> str:
        (router,) = self.ready_pods(f"serving.kvscale.io/router={NAME}")
        return f"http://{router['status']['podIP']}:8080"

    def router_health(self) -> dict[str, Any]:
        return httpx.get(self.router_url() + "/health", timeout=5).json()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router_url() + "/v1", api_key="unused", max_retries=0,
                             timeout=400)

    def wait_at_zero(self, timeout: float = 180) -> None:
        def at_zero() -> bool:
            resource = self.resource()
            conditions = {c["type"]: (c["status"], c["reason"])
                          for c in (resource.get("status") or {}).get("conditions", [])}
            return (resource["spec"]["replicas"] == 0 and not self.servers()
                    and conditions.get("Ready") == ("True", "ScaledToZero"))

        try:
            wait_until(at_zero, timeout, interval=0.5, what=f"{NAME} at zero replicas, Ready")
        except TimeoutError:
            raise AssertionError(f"not at zero: {json.dumps(self.resource().get('status'))}") from None

    def logs(self) -> str:
        runtime = self.raw.runtime
        return "\n".join(f"--- {ns}/{pod}\n" + runtime.log_tail(ns, pod, 30)
                         for ns, pod in list(runtime.workers) if ns in (NAMESPACE, "kvscale-system"))


def ask(client: openai.OpenAI, i: int) -> str:
    """One request, kind by index (completion / chat, streamed or not): "ok" or what failed."""
    try:
        if i % 4 == 0:
            text = client.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=4,
                                             temperature=0).choices[0].text
        elif i % 4 == 1:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=f"Number {i} is", max_tokens=4, temperature=0, stream=True)
                if c.choices)
        elif i % 4 == 2:
            text = client.chat.completions.create(
                model=MODEL, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": f"Say {i}"}]).choices[0].message.content or ""
        else:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, max_tokens=4, temperature=0, stream=True,
                messages=[{"role": "user", "content": f"Say {i}"}]) if c.choices)
        return "ok" if text else "empty answer"
    except Exception as exc:  # every failure counted, none hidden
        return f"{type(exc).__name__}: {exc}"


class Burst:
    """`n` requests sent at once from threads; `results` once joined."""

    def __init__(self, client: openai.OpenAI, n: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=n)
        self.futures = [self.pool.submit(ask, client, i) for i in range(n)]

    def results(self, timeout: float = 420) -> list[str]:
        out = [f.result(timeout=timeout) for f in self.futures]
        self.pool.shutdown()
        return out


@pytest.fixture(scope="module")
def cluster(process_cluster) -> Iterator[Cluster]:
    env = process_cluster.env
    install_operator(env, NAMESPACE)
    cluster = Cluster(process_cluster)
    resource = platform_inference_service(
        NAME, NAMESPACE, 0, max_model_len=1024,
        autoscaling={"enabled": True, "minReplicas": 0, "maxReplicas": 1,
                     "scaleToZeroAfterSeconds": IDLE_WINDOW_S,
                     # A cold start on a shared 2-core machine, with room.
                     "activationTimeoutSeconds": 400},
        router={"replicas": 1},
    )
    env.kubectl("apply", "-f", "-", input=json.dumps(resource))
    wait_until(lambda: cluster.ready_pods(f"serving.kvscale.io/router={NAME}"), 240,
               interval=1.0, what="the router ready with no server")
    yield cluster
    env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_200_requests_at_zero_replicas_are_all_answered(cluster: Cluster) -> None:
    cluster.wait_at_zero()
    # Zero replicas is a normal state in `kubectl get kvis`.
    row = cluster.kubectl("get", "kvis", NAME, "-n", NAMESPACE, "--no-headers").stdout.split()
    assert row[2:4] == ["0", "0"] and "ScaledToZero" in row, row
    assert cluster.router_health()["status"] == "ok"  # ready, with no server: it holds
    burst = Burst(cluster.client(), 200)
    try:
        results = burst.results()
    except Exception:
        raise AssertionError(cluster.logs()) from None
    failed = [r for r in results if r != "ok"]
    assert failed == [], (len(failed), failed[:5])
    # The operator writes the cold start at its first scrape that sees the replica ready, which can
    # come after the burst's last answer on a fast machine.
    status = wait_until(lambda: (s := cluster.resource()["status"]).get("lastColdStartSeconds") and s, 60,
                        interval=0.5, what="status.lastColdStartSeconds")
    assert status["lastColdStartSeconds"] > 0 and "activationStarted" not in status
    events = cluster.get("events", "-n", NAMESPACE, "--field-selector",
                         f"involvedObject.name={NAME}")["items"]
    assert any(e["reason"] == "Activated" for e in events), [e["reason"] for e in events]
    metrics = httpx.get(cluster.router_url() + "/metrics", timeout=5).text
    assert 'kvscale_router_holds_total{outcome="released"} 200.0' in metrics
    assert 'kvscale_router_holds_total{outcome="timeout"} 0.0' in metrics


def test_sparse_traffic_scales_down_once_per_idle_window_at_most(cluster: Cluster) -> None:
    """One request every 1.5 x the idle window: each may find the service at zero, but no scale
    down comes sooner than an idle window after an answer."""
    cluster.wait_at_zero()
    client = cluster.client()
    transitions: list[tuple[float, int]] = []  # (time, spec.replicas), on change
    stop = threading.Event()

    def watch() -> None:
        last = None
        while not stop.is_set():
            try:
                replicas = cluster.resource()["spec"]["replicas"]
            except Exception:  # one failed kubectl: the next poll sees it
                continue
            if replicas != last:
                transitions.append((time.monotonic(), replicas))
                last = replicas
            time.sleep(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    answers: list[float] = []
    results = []
    try:
        for i in range(3):
            results.append(ask(client, i))
            answers.append(time.monotonic())
            time.sleep(1.5 * IDLE_WINDOW_S)
    finally:
        stop.set()
        watcher.join(5)
    assert results == ["ok"] * 3, results
    # The first entry is the state the watch found (zero, after wait_at_zero), not a scale down.
    downs = [t for (t, replicas) in transitions[1:] if replicas == 0]
    assert len(downs) <= len(answers)
    for down in downs:
        previous = [a for a in answers if a < down]
        if previous:  # the window runs from the last answer (the request was open until then)
            assert down - previous[-1] >= IDLE_WINDOW_S - 1.0, (transitions, answers)


def test_requests_held_while_the_operator_is_gone_are_answered_when_it_is_back(cluster: Cluster) -> None:
    cluster.wait_at_zero()
    cluster.kubectl("scale", *OPERATOR, "--replicas=0")
    try:
        wait_until(lambda: not cluster.get("pods", "-n", "kvscale-system", "-l",
                                           "app.kubernetes.io/component=operator")["items"],
                   90, interval=0.5, what="no operator pod")
        burst = Burst(cluster.client(), 8)
        # The router raised the scale itself; with no operator nothing applies it yet.
        wait_until(lambda: cluster.router_health()["activation"]["held"] == 8, 60, interval=0.2,
                   what="8 requests held")
        wait_until(lambda: cluster.resource()["spec"]["replicas"] == 1, 30, interval=0.3,
                   what="the router's scale to 1")
        assert not cluster.servers()
    finally:
        cluster.kubectl("scale", *OPERATOR, "--replicas=2")
    results = burst.results()
    assert results == ["ok"] * 8, results


def test_requests_at_zero_with_redis_frozen_are_answered(cluster: Cluster) -> None:
    cluster.wait_at_zero()
    (redis_pod,) = cluster.ready_pods(f"serving.kvscale.io/redis={NAME}")
    runtime = cluster.raw.runtime
    runtime.kill(NAMESPACE, redis_pod["metadata"]["name"], signal.SIGSTOP)
    try:
        wait_until(lambda: cluster.router_health()["redis"] == "down", 30, interval=0.3,
                   what="the router seeing Redis down")
        results = Burst(cluster.client(), 8).results()
    finally:
        runtime.kill(NAMESPACE, redis_pod["metadata"]["name"], signal.SIGCONT)
    assert results == ["ok"] * 8, results


def test_the_routers_only_write_is_its_own_services_scale(cluster: Cluster) -> None:
    account = f"system:serviceaccount:{NAMESPACE}:{NAME}-router"

    def can(verb: str, resource: str) -> bool:
        proc = cluster.kubectl("auth", "can-i", verb, resource, "-n", NAMESPACE, f"--as={account}",
                               check=False)
        return proc.stdout.strip() == "yes"

    assert can("patch", f"inferenceservices.serving.kvscale.io/{NAME}") is False
    assert can("patch", "inferenceservices.serving.kvscale.io") is False
    assert can("get", "inferenceservices.serving.kvscale.io") is False
    # kubectl auth can-i names a subresource with --subresource.
    def can_scale(verb: str, name: str) -> bool:
        proc = cluster.kubectl("auth", "can-i", verb, f"inferenceservices.serving.kvscale.io/{name}",
                               "--subresource=scale", "-n", NAMESPACE, f"--as={account}", check=False)
        return proc.stdout.strip() == "yes"

    assert can_scale("patch", NAME) and can_scale("get", NAME)
    assert not can_scale("patch", "another") and not can_scale("update", NAME)
