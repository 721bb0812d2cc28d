"""The namespace-wide router: `kvscale router --k8s-namespace-wide` in front of every
InferenceService of one namespace, routing by the request's `model`.

The operator does not run it; the chart does (`namespaceRouter` values), from a template that
`kvscale operator render-router --helm` writes with these builders, so its pod is the
per-InferenceService router's pod but for the `RouterPod` fields set here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscale.operator.children.redis import redis_url_env
from kvscale.operator.children.router import (
    ENDPOINTSLICES_RULE,
    READ,
    RouterPod,
    build_router_deployment,
    build_router_pdb,
    build_router_rbac,
    router_api_key_env,
)
from kvscale.operator.spec import DEFAULT_ROUTER_IMAGE, GROUP, PLURAL, RedisSource, SecretKeyRef

COMPONENT = "namespace-router"
# Besides the servers' EndpointSlices: which pod serves which InferenceService (its label) and
# model.
NAMESPACE_WIDE_RULES: tuple[Mapping[str, Any], ...] = (
    ENDPOINTSLICES_RULE,
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": READ},
)


def default_resources() -> dict[str, Any]:
    return {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}


@dataclass(frozen=True)
class NamespaceRouterValues:
    """The chart's `namespaceRouter` values (defaults as in values.yaml, for release `kvscale`).
    Fields typed `int | str` take a Helm expression in the chart's template."""

    namespace: str = "default"
    name: str = "kvscale-router"
    instance: str = "kvscale"  # app.kubernetes.io/instance: the Helm release
    image: str = DEFAULT_ROUTER_IMAGE
    replicas: int | str = 2
    policy: str | None = "predicted-ttft"
    # The index all the namespace's servers publish to; none: it routes by load and health.
    redis: RedisSource = field(default_factory=RedisSource)
    api_key_secret: SecretKeyRef | None = None  # sent by clients, and on to the servers
    resources: Mapping[str, Any] = field(default_factory=default_resources)
    service_type: str = "ClusterIP"
    service_port: int | str = 80


def selector(values: NamespaceRouterValues) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvscale", "app.kubernetes.io/instance": values.instance,
            "app.kubernetes.io/component": COMPONENT}


def namespace_router(values: NamespaceRouterValues) -> RouterPod:
    return RouterPod(
        name=values.name,
        namespace=values.namespace,
        labels=selector(values),
        selector=selector(values),
        image=values.image,
        replicas=values.replicas,
        discovery=("--k8s-namespace-wide", "--namespace", values.namespace,
                   "--k8s-port-name", "http"),
        rules=NAMESPACE_WIDE_RULES,
        resources=values.resources,
        env=(*redis_url_env(values.redis, None), *router_api_key_env(values.api_key_secret)),
        policy=values.policy,
    )


def build_router_service(pod: RouterPod, service_type: str, port: int | str) -> dict[str, Any]:
    """Its OpenAI URL, one for every model of the namespace."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)},
        "spec": {
            "type": service_type,
            "selector": dict(pod.selector),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def namespace_router_objects(pod: RouterPod, service_type: str,
                             service_port: int | str) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, Deployment, Service, PodDisruptionBudget, in the order
    they are applied."""
    return [*build_router_rbac(pod), build_router_deployment(pod),
            build_router_service(pod, service_type, service_port), build_router_pdb(pod)]
