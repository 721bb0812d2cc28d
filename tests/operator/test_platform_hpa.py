"""The real HPA scales an InferenceService on the whole platform, every part real.

The chain: requests on the servers -> their vLLM gauges -> a real Prometheus (kubernetes_sd, the
chart's PodMonitor relabelling) -> prometheus-adapter built from Go modules, served as a pod
behind kube-apiserver's aggregation layer (custom.metrics.k8s.io) -> kube-controller-manager's
HPA controller -> the InferenceService's scale subresource -> the operator (autoscaling
disabled: it honours spec.replicas) -> a second `kvscale serve` pod; and back down once the load
stops, after the HPA's own scale-down stabilization (shortened through its `behavior`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from custom_metrics import CustomMetrics, start_custom_metrics
from operator_helpers import install_operator, platform_inference_service
from testenv import find_or_build_prometheus_adapter, ready_pods

from kvscale.operator.hpa import CONCURRENCY_METRIC, horizontal_pod_autoscaler
from kvscale.operator.spec import NAME_LABEL
from kvscale.processes import wait_until

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

NAMESPACE = "team-hpa"
NAME = "chat"
MODEL = "smollm2-135m-instruct"
TARGET_CONCURRENCY = 2
SCALE_DOWN_WINDOW_S = 10
WORKERS = 8  # in-flight requests on one replica: 4x the target, so the HPA wants more


@dataclass
class Cluster:
    raw: Any  # tests/conftest.py's ProcessCluster
    metrics: CustomMetrics
    failures: list[str] = field(default_factory=list)

    def get(self, *args: str) -> dict[str, Any]:
        return self.raw.env.kubectl_json("get", *args)

    def resource(self) -> dict[str, Any]:
        return self.get("inferenceservice", NAME, "-n", NAMESPACE)

    def hpa(self) -> dict[str, Any]:
        return self.get("hpa", NAME, "-n", NAMESPACE)

    def ready_servers(self) -> list[dict[str, Any]]:
        return ready_pods(self.raw.env, NAMESPACE, f"{NAME_LABEL}={NAME}")

    def servers(self) -> list[dict[str, Any]]:
        return self.get("pods", "-n", NAMESPACE, "-l", f"{NAME_LABEL}={NAME}")["items"]

    def router_url(self) -> str:
        (router,) = ready_pods(self.raw.env, NAMESPACE, f"serving.kvscale.io/router={NAME}")
        return f"http://{router['status']['podIP']}:8080"

    def hpa_events(self) -> list[str]:
        events = self.get("events", "-n", NAMESPACE, "--field-selector",
                          f"involvedObject.kind=HorizontalPodAutoscaler,involvedObject.name={NAME}")
        return [f"{e['reason']}: {e['message']}" for e in events["items"]]

    def diagnosis(self) -> str:
        runtime = self.raw.runtime
        logs = "\n".join(f"--- {ns}/{pod}\n" + runtime.log_tail(ns, pod, 20)
                         for ns, pod in list(runtime.workers)
                         if ns in (NAMESPACE, "kvscale-system", "custom-metrics"))
        return (f"hpa status: {json.dumps(self.hpa().get('status'))}\n"
                f"hpa events: {self.hpa_events()}\n"
                f"spec.replicas: {self.resource()['spec'].get('replicas')}\n{logs}")


def inference_service() -> dict[str, Any]:
    # The HPA owns spec.replicas: the operator's own autoscaler stays off.
    return platform_inference_service(NAME, NAMESPACE, 1, max_model_len=1024, autoscaling={"enabled": False},
                                      router={"replicas": 1})


@pytest.fixture(scope="module")
def cluster(process_cluster, tmp_path_factory) -> Iterator[Cluster]:
    env, runtime = process_cluster.env, process_cluster.runtime
    adapter = find_or_build_prometheus_adapter()
    install_operator(env, NAMESPACE)
    metrics = start_custom_metrics(env, runtime, tmp_path_factory.mktemp("custom-metrics"), adapter)
    cluster = Cluster(process_cluster, metrics)
    try:
        env.kubectl("apply", "-f", "-", input=json.dumps(inference_service()))
        wait_until(lambda: cluster.ready_servers() and ready_pods(
            env, NAMESPACE, f"serving.kvscale.io/router={NAME}"), 400, interval=1.0,
            what="one server and the router ready")
        hpa = horizontal_pod_autoscaler(NAME, NAMESPACE, min_replicas=1, max_replicas=2,
                                        target_concurrency=TARGET_CONCURRENCY,
                                        scale_down_stabilization_s=SCALE_DOWN_WINDOW_S)
        env.kubectl("apply", "-f", "-", input=json.dumps(hpa))
        yield cluster
    finally:
        env.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        metrics.stop()


def load(cluster: Cluster, stop: threading.Event) -> list[threading.Thread]:
    """WORKERS clients, each with one streamed request in flight at all times until ``stop``."""
    client = openai.OpenAI(base_url=cluster.router_url() + "/v1", api_key="unused", max_retries=0,
                           timeout=300)

    def worker(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                for _ in client.chat.completions.create(
                        model=MODEL, max_tokens=96, temperature=0, stream=True,
                        messages=[{"role": "user", "content": f"Tell story {i}-{n} about a pod."}]):
                    pass
            except Exception as exc:  # every failure counted, none hidden
                cluster.failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(WORKERS)]
    for t in threads:
        t.start()
    return threads


def test_the_custom_metrics_api_serves_concurrency_per_pod_and_per_service(cluster: Cluster) -> None:
    (server,) = cluster.ready_servers()
    pod = server["metadata"]["name"]
    # Idle: the adapter answers 0 for the server (Prometheus scraped it; the adapter relisted).
    wait_until(lambda: cluster.metrics.pod_metric(NAMESPACE, CONCURRENCY_METRIC) == {pod: 0.0}, 120,
               interval=1.0, what=f"{CONCURRENCY_METRIC} of {pod} in custom.metrics.k8s.io")
    body = cluster.metrics.raw(f"/apis/custom.metrics.k8s.io/v1beta2/namespaces/{NAMESPACE}/"
                               f"inferenceservices.serving.kvscale.io/{NAME}/{CONCURRENCY_METRIC}")
    assert body is not None and len(body["items"]) == 1, body  # a MetricValueList of one
    (item,) = body["items"]
    assert item["describedObject"]["kind"] == "InferenceService", item
    assert item["describedObject"]["name"] == NAME and item["value"] == "0", item


def test_load_scales_out_through_the_real_hpa_and_back_in(cluster: Cluster) -> None:
    def hpa_active() -> bool:
        conditions = {c["type"]: c for c in (cluster.hpa().get("status") or {}).get("conditions", [])}
        return conditions.get("ScalingActive", {}).get("status") == "True"

    try:
        wait_until(hpa_active, 120, interval=1.0, what="the HPA's ScalingActive condition")
    except TimeoutError:
        raise AssertionError(cluster.diagnosis()) from None
    assert cluster.resource()["spec"]["replicas"] == 1

    stop = threading.Event()
    threads = load(cluster, stop)
    seen: list[float] = []
    try:
        def scaled_out() -> bool:
            values = cluster.metrics.pod_metric(NAMESPACE, CONCURRENCY_METRIC)
            seen.extend(values.values())
            return cluster.resource()["spec"]["replicas"] == 2 and len(cluster.ready_servers()) == 2

        try:
            wait_until(scaled_out, 400, interval=1.0, what="a second ready server under load")
        except TimeoutError:
            raise AssertionError(f"concurrency seen: {seen[-10:]}\n{cluster.diagnosis()}") from None
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert max(seen) > TARGET_CONCURRENCY, seen
    assert cluster.failures == [], cluster.failures[:5]
    # The HPA wrote it (not the operator, whose autoscaler is off): its event and status say so.
    assert any(e.startswith("SuccessfulRescale: New size: 2") for e in cluster.hpa_events()), \
        cluster.hpa_events()
    assert "desiredReplicas" not in (cluster.resource().get("status") or {})  # operator stayed out

    # Idle again: after the scale-down window, back to minReplicas, and the pod is gone.
    try:
        wait_until(lambda: cluster.resource()["spec"]["replicas"] == 1 and len(cluster.servers()) == 1,
                   240, interval=1.0, what="back to one server once idle")
    except TimeoutError:
        raise AssertionError(cluster.diagnosis()) from None
    assert any(e.startswith("SuccessfulRescale: New size: 1") for e in cluster.hpa_events()), \
        cluster.hpa_events()


def test_the_operator_stands_aside_when_its_autoscaler_is_turned_on_beside_the_hpa(
        cluster: Cluster) -> None:
    """enabled: true with an HPA on the same service: no fight, a readable condition instead."""
    env = cluster.raw.env

    def scaling_active() -> dict[str, Any]:
        conditions = (cluster.resource().get("status") or {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == "ScalingActive"), {})

    env.kubectl("patch", "inferenceservice", NAME, "-n", NAMESPACE, "--type=merge",
                "-p", json.dumps({"spec": {"autoscaling": {"enabled": True, "minReplicas": 1,
                                                           "maxReplicas": 2}}}))
    try:
        wait_until(lambda: scaling_active().get("reason") == "ExternalAutoscaler", 60,
                   interval=1.0, what="ScalingActive False/ExternalAutoscaler")
        condition = scaling_active()
        assert condition["status"] == "False", condition
        assert f"HorizontalPodAutoscaler {NAME} also scale" in condition["message"], condition
        assert "set spec.autoscaling.enabled to false" in condition["message"], condition
        assert "desiredReplicas" not in (cluster.resource().get("status") or {})
        events = cluster.get("events", "-n", NAMESPACE, "--field-selector",
                             f"involvedObject.kind=InferenceService,involvedObject.name={NAME}")
        assert any("ExternalAutoscaler" in (e.get("reason", "") + e.get("message", ""))
                   for e in events["items"]), [e["reason"] for e in events["items"]]
    finally:
        env.kubectl("patch", "inferenceservice", NAME, "-n", NAMESPACE, "--type=merge",
                    "-p", json.dumps({"spec": {"autoscaling": {"enabled": False}}}))
    wait_until(lambda: scaling_active().get("reason") == "AutoscalingDisabled", 60, interval=1.0,
               what="ScalingActive back to AutoscalingDisabled")
