"""The Redis holding one InferenceService's KV index, run by the operator (pure builders).

The index is a cache the replicas rebuild by republishing, so this Redis keeps nothing on disk:
no persistence, one replica, a password from a Secret generated once and never rotated by a
reconcile. An external Redis (`spec.router.redis`) replaces all of it.
"""

from __future__ import annotations

import secrets
from typing import Any

from kvscale.operator.spec import REDIS_PORT, InferenceServiceSpec

PASSWORD_KEY = "password"
PASSWORD_ENV = "KVSCALE_REDIS_PASSWORD"
URL_ENV = "KVSCALE_REDIS_URL"
REDIS_LABEL = "serving.kvscale.io/redis"
RUN_AS_USER = 999  # the redis user of the official image


def redis_name(name: str) -> str:
    return f"{name}-redis"


def redis_labels(name: str) -> dict[str, str]:
    return {
        REDIS_LABEL: name,
        "app.kubernetes.io/name": "kvscale",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "kv-index",
        "app.kubernetes.io/managed-by": "kvscale-operator",
    }


def redis_host(name: str, namespace: str) -> str:
    # Namespace-qualified but without the cluster domain, so it resolves whatever the domain is.
    return f"{redis_name(name)}.{namespace}.svc"


def redis_url_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """Env giving a server or router pod the index's URL in $KVSCALE_REDIS_URL (never in args)."""
    redis = spec.router.redis
    if redis.secret_ref is not None:
        return [{"name": URL_ENV, "valueFrom": {"secretKeyRef": {
            "name": redis.secret_ref.name, "key": redis.secret_ref.key}}}]
    if redis.url is not None:
        return [{"name": URL_ENV, "value": redis.url}]
    return [
        {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
            "name": redis_name(name), "key": PASSWORD_KEY}}},
        # Kubernetes expands $(VAR) from the variables defined before this one.
        {"name": URL_ENV,
         "value": f"redis://:$({PASSWORD_ENV})@{redis_host(name, namespace)}:{REDIS_PORT}/0"},
    ]


def build_redis_secret(name: str, namespace: str) -> dict[str, Any]:
    """Created once (never applied again): a reconcile must not change a live password."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": redis_name(name), "namespace": namespace, "labels": redis_labels(name)},
        "type": "Opaque",
        # URL-safe, so it can sit in a redis:// URL unescaped.
        "stringData": {PASSWORD_KEY: secrets.token_urlsafe(32)},
    }


def build_redis_deployment(name: str, namespace: str, image: str) -> dict[str, Any]:
    labels = redis_labels(name)
    container = {
        "name": "redis",
        "image": image,
        "command": ["redis-server"],
        "args": [
            # The pod's own address, like every kvscale pod (see the servers' --host).
            "--bind", "$(POD_IP)",
            "--port", str(REDIS_PORT),
            "--requirepass", f"$({PASSWORD_ENV})",
            "--save", "", "--appendonly", "no",
            # Bounded memory: the index is a cache, and an evicted key only costs a prefix miss.
            "--maxmemory", "200mb", "--maxmemory-policy", "allkeys-lru",
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": {
                "name": redis_name(name), "key": PASSWORD_KEY}}},
        ],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": RUN_AS_USER, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": redis_name(name), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {REDIS_LABEL: name}},
            # Two Redis pods would split the index: the old one goes before the new one starts.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [container],
                    "volumes": [{"name": "data", "emptyDir": {}}],
                },
            },
        },
    }


def build_redis_service(name: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": redis_name(name), "namespace": namespace, "labels": redis_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": {REDIS_LABEL: name},
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
