"""What the pods the operator makes share, written once: security contexts, probes, the
downward-API environment, the API key's environment, the scrape annotations, preStop and the
drain's share of the termination grace period.
"""

from __future__ import annotations

from typing import Any

from kvscale.operator.spec import SecretKeyRef

# The image's user (Dockerfile, Dockerfile.control-plane): the restricted Pod Security Standard
# wants a non-root uid, and a numeric one lets the kubelet check it without reading the image.
RUN_AS_USER = 1000
# Before SIGTERM: time for the EndpointSlice change to reach every router (which then stops
# sending), then the process drains for what is left of the grace period, less a margin for
# uvicorn and the process's exit.
PRE_STOP_SLEEP_SECONDS = 5
SHUTDOWN_MARGIN_SECONDS = 10
API_KEY_ENV = "KVSCALE_API_KEY"
REPLICA_API_KEY_ENV = "KVSCALE_REPLICA_API_KEY"

EnvVar = dict[str, Any]


def shutdown_timeout(grace_seconds: int) -> int:
    """--shutdown-timeout for a pod with this termination grace period."""
    return grace_seconds - PRE_STOP_SLEEP_SECONDS - SHUTDOWN_MARGIN_SECONDS


def pre_stop() -> dict[str, Any]:
    # The kubelet's own sleep action: no `sleep` binary needed in the image.
    return {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}}


def pod_security_context(user: int = RUN_AS_USER, *, group: int | None = RUN_AS_USER) -> dict[str, Any]:
    """Restricted Pod Security; `group` None leaves the group and fsGroup to the image."""
    context: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": user}
    if group is not None:
        context |= {"runAsGroup": group, "fsGroup": group}
    return context | {"seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context(user: int = RUN_AS_USER) -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": user,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(period: int, failures: int, timeout: int = 3, path: str = "/health") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    """For what speaks no HTTP (Redis)."""
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "failureThreshold": failures}


def field_env(*names: str) -> list[EnvVar]:
    """POD_IP, POD_NAME, POD_NAMESPACE from the downward API (in the order given)."""
    paths = {"POD_IP": "status.podIP", "POD_NAME": "metadata.name",
             "POD_NAMESPACE": "metadata.namespace"}
    return [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": paths[name]}}} for name in names]


def secret_env(env_name: str, ref: SecretKeyRef) -> EnvVar:
    return {"name": env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}


def api_key_env(ref: SecretKeyRef | None, env_name: str = API_KEY_ENV) -> list[EnvVar]:
    """The key clients must send, from its Secret: never in the args, never in clear."""
    return [] if ref is None else [secret_env(env_name, ref)]


def scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}


def rolling_update() -> dict[str, Any]:
    # A new pod must be ready before an old one goes: keep serving through rollouts.
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def http_port(port: int) -> dict[str, Any]:
    return {"name": "http", "containerPort": port, "protocol": "TCP"}


def topology_spread(selector: dict[str, str]) -> list[dict[str, Any]]:
    """Replicas spread over nodes, then zones, so that one node drain or zone outage never takes
    every replica at once. ScheduleAnyway: a one-node cluster (or one GPU node) still runs them
    all rather than leaving pods Pending."""
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": dict(selector)}}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")]
