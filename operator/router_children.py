"""The router in front of one InferenceService's servers (pure builders).

`kvscale router` pods find the servers through the EndpointSlices of the servers' headless
Service (ready endpoints only), read and publish the KV index in Redis, and are what the
InferenceService's own Service selects: clients keep one URL whether a router runs or not.
"""

from __future__ import annotations

from typing import Any

from kvscale.operator import redis_children
from kvscale.operator.builders import (
    api_key_env,
    container_security_context,
    headless_service_name,
    pod_security_context,
    pre_stop,
    shutdown_timeout,
)
from kvscale.operator.spec import ROUTER_PORT, InferenceServiceSpec

ROUTER_LABEL = "serving.kvscale.io/router"
# Routers hold open streams: time for them to finish after SIGTERM.
ROUTER_TERMINATION_GRACE_PERIOD_SECONDS = 60


def router_name(name: str) -> str:
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    return {ROUTER_LABEL: name}


def router_labels(name: str) -> dict[str, str]:
    return {
        **router_selector(name),
        "app.kubernetes.io/name": "kvscale",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "router",
        "app.kubernetes.io/managed-by": "kvscale-operator",
    }


def router_args(name: str, spec: InferenceServiceSpec) -> list[str]:
    """`kvscale router` flags; the Redis URL and keys come from the environment."""
    args = [
        "router",
        "--host", "$(POD_IP)",
        "--port", str(ROUTER_PORT),
        "--k8s-service", headless_service_name(name),
        "--namespace", "$(POD_NAMESPACE)",
        "--k8s-port-name", "http",
        "--shutdown-timeout", str(shutdown_timeout(ROUTER_TERMINATION_GRACE_PERIOD_SECONDS)),
    ]
    if spec.router.policy is not None:
        args += ["--policy", spec.router.policy]
    if spec.router.balance_epsilon is not None:
        args += ["--balance-epsilon", str(spec.router.balance_epsilon)]
    return args


def router_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        *redis_children.redis_url_env(name, namespace, spec),
    ]
    # Clients send the service's key to the router, and the router sends it on to the servers.
    env += api_key_env(spec, "KVSCALE_API_KEY") + api_key_env(spec, "KVSCALE_REPLICA_API_KEY")
    return env


def build_router_deployment(name: str, namespace: str, spec: InferenceServiceSpec,
                            image: str) -> dict[str, Any]:
    labels = router_labels(name)
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 2,
             "failureThreshold": 2, "timeoutSeconds": 2}
    container = {
        "name": "router",
        "image": image,
        "command": ["kvscale"],
        "args": router_args(name, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": router_env(name, namespace, spec),
        "resources": {
            "requests": {"cpu": spec.router.resources.cpu, "memory": spec.router.resources.memory},
            "limits": {"memory": spec.router.resources.memory},
        },
        # /health is 503 while no server is ready: right for readiness, wrong for liveness.
        "readinessProbe": probe,
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 3},
        "lifecycle": pre_stop(),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_name(name), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector(name)},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": labels, "annotations": {
                    "prometheus.io/scrape": "true",
                    "prometheus.io/port": str(ROUTER_PORT),
                    "prometheus.io/path": "/metrics",
                }},
                "spec": {
                    "serviceAccountName": router_name(name),
                    "securityContext": pod_security_context(),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_PERIOD_SECONDS,
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def build_router_pdb(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": router_selector(name)}},
    }


def build_router_rbac(name: str, namespace: str) -> list[dict[str, Any]]:
    """Its own ServiceAccount, allowed only to read the EndpointSlices it routes by."""
    meta = {"name": router_name(name), "namespace": namespace, "labels": router_labels(name)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": router_name(name)},
            "subjects": [{"kind": "ServiceAccount", "name": router_name(name),
                          "namespace": namespace}],
        },
    ]

