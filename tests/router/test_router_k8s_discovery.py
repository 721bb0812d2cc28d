"""Replica discovery from a headless Service's EndpointSlices, against a real kube-apiserver.

The slices are written by hand (a Service without a selector, so no controller touches them).
Every endpoint address is 127.0.0.1: no traffic may leave this machine. The apiserver refuses
loopback IPs in IPv4 slices, so the slices are of addressType FQDN, where "127.0.0.1" is a valid
name (four numeric labels) that resolves to itself. Distinct replicas differ by port, hence one
slice each. Nothing listens on those ports; discovery alone is under test, not health.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest

from kvscale.processes import free_port
from kvscale.router.replicas import EndpointSliceWatch, ReplicaSet

pytestmark = [pytest.mark.slow, pytest.mark.k8s]

LOOPBACK = "127.0.0.1"  # the only address a test may hand out: no traffic leaves this machine
FOLLOW_S = 5.0  # how soon a slice change must show in the replica set


def _apply(env, *manifests: dict) -> None:
    env.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}))


def _namespace(env, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    env.kubectl("create", "namespace", name)
    return name


def _headless_service(name: str, namespace: str) -> dict:
    # No selector: the EndpointSlice controller leaves this Service's slices to us.
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 8000, "targetPort": 8000}]},
    }


def _endpoint(ready: bool | None) -> dict:
    endpoint: dict = {"addresses": [LOOPBACK]}
    if ready is not None:  # None: no conditions at all, which the API says reads as ready
        endpoint["conditions"] = {"ready": ready}
    return endpoint


def _slice(name: str, namespace: str, service: str, port: int, endpoints: list[dict],
           extra_ports: list[dict] | None = None) -> dict:
    for endpoint in endpoints:
        assert endpoint["addresses"] == [LOOPBACK]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "FQDN",
        "ports": (extra_ports or []) + [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def _url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def test_endpointslice_watch_follows_ready_endpoints(k8s_env):
    """In process: the watch thread feeds a ReplicaSet on an asyncio loop, as the router runs it."""
    env = k8s_env
    ns = _namespace(env, "router-disc")
    service = "pool"
    port_a, port_b, port_c, port_other = (free_port() for _ in range(4))
    _apply(
        env,
        _headless_service(service, ns),
        _headless_service("other", ns),
        _slice("pool-a", ns, service, port_a, [_endpoint(True)]),
        _slice("pool-b", ns, service, port_b, [_endpoint(False)]),
        # Another Service's slice in the same namespace must never leak in.
        _slice("other-a", ns, "other", port_other, [_endpoint(True)]),
    )

    async def scenario() -> None:
        replicas = ReplicaSet()
        watch = EndpointSliceWatch(service, ns, replicas.set_urls, asyncio.get_running_loop(),
                                   kubeconfig=str(env.kubeconfig))

        async def expect(urls: set[str], why: str) -> None:
            deadline = time.monotonic() + FOLLOW_S
            while set(replicas.replicas) != urls:
                if time.monotonic() > deadline:
                    pytest.fail(f"{why}: replicas {sorted(replicas.replicas)} != {sorted(urls)} after {FOLLOW_S}s")
                await asyncio.sleep(0.05)

        async def apply(*manifests: dict) -> None:
            await asyncio.to_thread(_apply, env, *manifests)

        watch.start()
        try:
            # From the initial list: the ready endpoint only.
            await expect({_url(port_a)}, "initial list")
            assert replicas.replicas[_url(port_a)].replica_id == f"{LOOPBACK}:{port_a}"

            # ADDED through the watch; no conditions reads as ready.
            await apply(_slice("pool-c", ns, service, port_c, [_endpoint(None)]))
            await expect({_url(port_a), _url(port_c)}, "slice added")

            # MODIFIED: b becomes ready, then a stops being ready.
            await apply(_slice("pool-b", ns, service, port_b, [_endpoint(True)]))
            await expect({_url(port_a), _url(port_b), _url(port_c)}, "endpoint marked ready")
            await apply(_slice("pool-a", ns, service, port_a, [_endpoint(False)]))
            await expect({_url(port_b), _url(port_c)}, "endpoint marked not ready")

            # An endpoint removed from its slice goes; a ready one beside a not-ready one stays.
            await apply(_slice("pool-c", ns, service, port_c, []),
                        _slice("pool-b", ns, service, port_b, [_endpoint(False), _endpoint(True)]))
            await expect({_url(port_b)}, "endpoint removed")

            # DELETED: deleting the slices empties the set.
            await asyncio.to_thread(env.kubectl, "delete", "endpointslice", "-n", ns, "pool-b")
            await expect(set(), "slice deleted")
            await asyncio.to_thread(env.kubectl, "delete", "endpointslice", "-n", ns, "pool-a", "pool-c")
            await asyncio.sleep(0.5)
            assert replicas.replicas == {}

            # And a slice created afterwards still arrives: the watch lives on.
            await apply(_slice("pool-d", ns, service, port_a, [_endpoint(True)]))
            await expect({_url(port_a)}, "slice re-added")
        finally:
            watch.stop()

    try:
        asyncio.run(scenario())
    finally:
        env.kubectl("delete", "namespace", ns, "--wait=false")


def test_router_cli_discovers_replicas_from_k8s_service(k8s_env, launcher):
    """`kvscale router --k8s-service` with $KUBECONFIG: /health lists exactly the ready endpoints."""
    env = k8s_env
    ns = _namespace(env, "router-cli")
    service = "replicas"
    port_a, port_b = free_port(), free_port()
    metrics_port = {"name": "metrics", "port": free_port(), "protocol": "TCP"}
    _apply(
        env,
        _headless_service(service, ns),
        # The first port is not the one to route to: --k8s-port-name picks "http".
        _slice("replicas-a", ns, service, port_a, [_endpoint(True)], extra_ports=[metrics_port]),
        _slice("replicas-b", ns, service, port_b, [_endpoint(False)], extra_ports=[metrics_port]),
    )
    try:
        # Out of cluster: the kubeconfig is the one it uses. /health is 503 with no healthy
        # replica, so the router counts as up once /metrics answers.
        router = launcher.router(
            None, None, extra=["--k8s-service", service, "--namespace", ns, "--k8s-port-name", "http"],
            health_path="/metrics", env={"KUBECONFIG": str(env.kubeconfig), "KUBERNETES_SERVICE_HOST": None},
        )

        def expect(urls: set[str], why: str) -> None:
            deadline = time.monotonic() + FOLLOW_S
            while True:
                listed = {r["url"] for r in httpx.get(f"{router.url}/health", timeout=2.0).json()["replicas"]}
                if listed == urls:
                    return
                if time.monotonic() > deadline:
                    pytest.fail(f"{why}: router lists {sorted(listed)} != {sorted(urls)}\n{router.log_tail()}")
                time.sleep(0.1)

        expect({_url(port_a)}, "initial list")
        # Nothing listens there, so the router knows the replica but will not route to it.
        health = httpx.get(f"{router.url}/health", timeout=2.0)
        assert health.status_code == 503
        assert [r["healthy"] for r in health.json()["replicas"]] == [False]

        _apply(env, _slice("replicas-b", ns, service, port_b, [_endpoint(True)], extra_ports=[metrics_port]))
        expect({_url(port_a), _url(port_b)}, "endpoint marked ready")
        env.kubectl("delete", "endpointslice", "-n", ns, "replicas-a", "replicas-b")
        expect(set(), "slices deleted")
        assert router.proc.poll() is None, router.log_tail()
    finally:
        env.kubectl("delete", "namespace", ns, "--wait=false")
