"""The Redis holding one InferenceService's KV index, and the environment giving the servers and
the router its URL.

The index is a cache the replicas rebuild by republishing, so this Redis keeps nothing on disk:
no persistence, one replica, a password from a Secret generated once and never rotated by a
reconcile. An external Redis (`spec.router.redis`) replaces all of it.

The password never reaches a command line: the kubelet expands `$(VAR)` in args before the
runtime starts the process, so `--requirepass $(PASSWORD)` would put it in the container's
recorded config and in /proc/PID/cmdline. Redis is given the SHA-256 of it instead, as an ACL
rule for its default user (`#<hex>`); the servers and routers read the password itself from the
Secret into their environment. The operator writes the Secret once and never reads it (its RBAC
has no `get` on Secrets), so both keys are made together here.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from kvscale.operator.children.labels import redis_host, redis_labels, redis_name, redis_selector
from kvscale.operator.children.pod_parts import (
    EnvVar,
    container_security_context,
    pod_security_context,
    secret_env,
    tcp_probe,
)
from kvscale.operator.spec import REDIS_PORT, InferenceServiceSpec, RedisSource, SecretKeyRef

PASSWORD_KEY = "password"
PASSWORD_SHA256_KEY = "password-sha256"
PASSWORD_ENV = "KVSCALE_REDIS_PASSWORD"
PASSWORD_SHA256_ENV = "KVSCALE_REDIS_PASSWORD_SHA256"
URL_ENV = "KVSCALE_REDIS_URL"
RUN_AS_USER = 999  # the redis user of the official image


def redis_url_env(source: RedisSource, internal: tuple[str, str] | None) -> list[EnvVar]:
    """Env giving a server or router pod the index's URL in $KVSCALE_REDIS_URL (never in args):
    the external Redis `source` names, else the operator's own Redis of the InferenceService
    `internal` (name, namespace), else none (a router then routes without the index)."""
    if source.secret_ref is not None:
        return [secret_env(URL_ENV, source.secret_ref)]
    if source.url is not None:
        return [{"name": URL_ENV, "value": source.url}]
    if internal is None:
        return []
    name, namespace = internal
    return [
        secret_env(PASSWORD_ENV, SecretKeyRef(redis_name(name), PASSWORD_KEY)),
        # Kubernetes expands $(VAR) from the variables defined before this one.
        {"name": URL_ENV,
         "value": f"redis://:$({PASSWORD_ENV})@{redis_host(name, namespace)}:{REDIS_PORT}/0"},
    ]


def service_redis_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[EnvVar]:
    """The index of the InferenceService `name`: its external Redis or the operator's."""
    return redis_url_env(spec.router.redis, (name, namespace))


def build_redis_secret(name: str, namespace: str) -> dict[str, Any]:
    """Created once (never applied again): a reconcile must not change a live password."""
    # URL-safe, so it can sit in a redis:// URL unescaped; 256 random bits, so its hash on
    # Redis's command line gives nothing away.
    password = secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": redis_name(name), "namespace": namespace, "labels": redis_labels(name)},
        "type": "Opaque",
        "stringData": {PASSWORD_KEY: password,
                       PASSWORD_SHA256_KEY: hashlib.sha256(password.encode()).hexdigest()},
    }


def redis_container(name: str, image: str) -> dict[str, Any]:
    return {
        "name": "redis",
        "image": image,
        "command": ["redis-server"],
        "args": [
            # Every address of the pod, IPv4 and IPv6 ("-": where the pod has it), as every
            # kvscale pod listens: Services, probes and port-forward (localhost) all reach it.
            "--bind", "* -::*",
            "--port", str(REDIS_PORT),
            # The default user needs the password whose SHA-256 this is (not the password:
            # see the module's docstring); resetpass drops the image's `nopass`.
            "--user", "default", "on", "resetpass", f"#$({PASSWORD_SHA256_ENV})",
            "~*", "&*", "+@all",
            "--save", "", "--appendonly", "no",
            # Bounded memory: the index is a cache, and an evicted key only costs a prefix miss.
            "--maxmemory", "200mb", "--maxmemory-policy", "allkeys-lru",
        ],
        "env": [secret_env(PASSWORD_SHA256_ENV, SecretKeyRef(redis_name(name), PASSWORD_SHA256_KEY))],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": tcp_probe("redis", 2, 2),
        "livenessProbe": tcp_probe("redis", 10, 3),
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": container_security_context(RUN_AS_USER),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }


def build_redis_deployment(name: str, namespace: str, image: str) -> dict[str, Any]:
    labels = redis_labels(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": redis_name(name), "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": redis_selector(name)},
            # Two Redis pods would split the index: the old one goes before the new one starts.
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # The uid alone: the index's volume is an emptyDir, writable without an fsGroup.
                    "securityContext": pod_security_context(RUN_AS_USER, group=None),
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "containers": [redis_container(name, image)],
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
            "selector": redis_selector(name),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
