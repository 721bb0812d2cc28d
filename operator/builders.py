"""The children of an InferenceService, as plain dicts built from its spec (pure functions).

The operator server-side-applies exactly these objects, so what they leave out is left to the API
server's defaults (and to other field managers) rather than fought over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscale.k8s_labels import SERVERS_ENDPOINTS_LABEL, SERVERS_ENDPOINTS_VALUE
from kvscale.operator.spec import (
    DEFAULT_REDIS_IMAGE,
    DEFAULT_ROUTER_IMAGE,
    NAME_LABEL,
    SERVER_PORT,
    InferenceServiceSpec,
)

BUNDLED_MODEL_NAME = "smollm2-135m-instruct"
MODEL_VOLUME_PATH = "/models"
METRICS_URL_ANNOTATION = "serving.kvscale.io/metrics-url"
DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
# Model load (and the bundled model's one-time conversion) can take minutes: the startup probe
# allows 30 minutes before liveness takes over.
STARTUP_PROBE_PERIOD_SECONDS = 10
STARTUP_PROBE_FAILURES = 180
RUN_AS_USER = 1000
# Time for in-flight streams to finish after SIGTERM before the kubelet kills the server.
TERMINATION_GRACE_PERIOD_SECONDS = 60
# Before SIGTERM: time for the EndpointSlice change to reach every router (which then stops
# sending), then the process drains for what is left of the grace period, less a margin for
# uvicorn and the process's exit.
PRE_STOP_SLEEP_SECONDS = 5
SHUTDOWN_MARGIN_SECONDS = 10


def shutdown_timeout(grace_seconds: int) -> int:
    """--shutdown-timeout for a pod with this termination grace period."""
    return grace_seconds - PRE_STOP_SLEEP_SECONDS - SHUTDOWN_MARGIN_SECONDS


def pre_stop() -> dict[str, Any]:
    # The kubelet's own sleep action: no `sleep` binary needed in the image.
    return {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}}


@dataclass(frozen=True)
class Images:
    """Images of the parts the operator runs beside the servers (the servers' is in the spec)."""

    router: str = DEFAULT_ROUTER_IMAGE
    redis: str = DEFAULT_REDIS_IMAGE


def selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: name}


def child_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/name": "kvscale",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "inference-server",
        "app.kubernetes.io/managed-by": "kvscale-operator",
    }


def selector_string(name: str) -> str:
    """The pods' selector in the string form the scale subresource reports."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(name).items()))


def headless_service_name(name: str) -> str:
    return f"{name}-pods"


def service_url(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """The Service named like the InferenceService: the router's, or the servers' without one."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}"


def model_path_and_init(spec: InferenceServiceSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """The server's --model value (None: its bundled default) and any init container fetching it."""
    model = spec.model
    if model.scheme == "bundled":
        return None, []
    if model.scheme == "pvc":
        claim, path = model.location.split("/", 1)
        return f"{MODEL_VOLUME_PATH}/pvc/{claim}/{path.strip('/')}", []
    # hf://ORG/NAME: the server never downloads, so an init container fetches into the volume.
    target = f"{MODEL_VOLUME_PATH}/hf/{model.location}"
    fetch = {
        "name": "fetch-model",
        "image": spec.image,
        "command": ["hf", "download", model.location, "--local-dir", target],
        # The image keeps servers offline (HF_HUB_OFFLINE=1); this container is the one that
        # downloads, so it turns that off for itself.
        "env": [{"name": "HF_HOME", "value": f"{MODEL_VOLUME_PATH}/hf-home"},
                {"name": "HF_HUB_OFFLINE", "value": "0"}],
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_VOLUME_PATH},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
    }
    return target, [fetch]


def server_args(spec: InferenceServiceSpec, model_path: str | None) -> list[str]:
    """`kvscale serve` flags, spelled as vLLM spells them."""
    engine = spec.engine
    args = ["serve"]
    if model_path is not None:
        args += ["--model", model_path]
    args += [
        "--served-model-name", spec.model.served_name,
        # The pod's own address: what it binds and what its heartbeats tell the router to call.
        "--host", "$(POD_IP)",
        "--port", str(SERVER_PORT),
        "--dtype", engine.dtype,
        "--block-size", str(engine.block_size),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--gpu-memory-utilization", str(engine.gpu_memory_utilization),
        "--shutdown-timeout", str(shutdown_timeout(TERMINATION_GRACE_PERIOD_SECONDS)),
    ]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching
                else "--no-enable-prefix-caching")
    if spec.router.enabled:
        # The Redis URL comes from $KVSCALE_REDIS_URL, the API key from $KVSCALE_API_KEY:
        # secrets never sit in the args.
        args += ["--replica-id", "$(POD_NAME)"]
    return args + list(engine.extra_args)


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def api_key_env(spec: InferenceServiceSpec, env_name: str = "KVSCALE_API_KEY") -> list[dict[str, Any]]:
    if spec.api_key_secret is None:
        return []
    return [{"name": env_name, "valueFrom": {"secretKeyRef": {
        "name": spec.api_key_secret.name, "key": spec.api_key_secret.key}}}]


def container_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    # No CPU limit: throttling the engine loop hurts latency more than it protects neighbours.
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    if spec.resources.gpus > 0:
        requests["nvidia.com/gpu"] = spec.resources.gpus
        limits["nvidia.com/gpu"] = spec.resources.gpus
    return {"requests": requests, "limits": limits}


def http_probe(period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def server_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    from kvscale.operator.redis_children import redis_url_env

    # KVSCALE_CACHE is left to the image, which ships the bundled model converted (Dockerfile).
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": f"{MODEL_VOLUME_PATH}/hf-home"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    if spec.router.enabled:
        env += redis_url_env(name, namespace, spec)
    return env + api_key_env(spec)


def volumes_and_mounts(spec: InferenceServiceSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "model-cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        # Shared memory for the engine's worker processes; the default 64 MiB is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "model-cache", "mountPath": MODEL_VOLUME_PATH},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    if spec.model.scheme == "pvc":
        claim = spec.model.location.split("/", 1)[0]
        volumes.append({"name": "model-pvc",
                        "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model-pvc", "mountPath": f"{MODEL_VOLUME_PATH}/pvc/{claim}",
                       "readOnly": True})
    return volumes, mounts


def build_deployment(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    model_path, init_containers = model_path_and_init(spec)
    volumes, mounts = volumes_and_mounts(spec)
    labels = child_labels(name)
    container = {
        "name": "server",
        "image": spec.image,
        "command": ["kvscale"],
        "args": server_args(spec, model_path),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": server_env(name, namespace, spec),
        "resources": container_resources(spec),
        "startupProbe": http_probe(STARTUP_PROBE_PERIOD_SECONDS, STARTUP_PROBE_FAILURES),
        "readinessProbe": http_probe(5, 3),
        "livenessProbe": http_probe(10, 6),
        "lifecycle": pre_stop(),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        # The server needs no API access; the operator and the router have their own accounts.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_PERIOD_SECONDS,
        "containers": [container],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            # A new replica must be ready before an old one goes: keep serving through rollouts.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SERVER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": pod_spec,
            },
        },
    }


def build_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The service's OpenAI URL: the router pods when a router runs, else the servers."""
    from kvscale.operator.router_children import router_selector

    selector = router_selector(name) if spec.router.enabled else selector_labels(name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": child_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_headless_service(name: str, namespace: str) -> dict[str, Any]:
    """Per-pod DNS and endpoints, for the prefix-aware router to find every replica."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": headless_service_name(name), "namespace": namespace,
                     # Copied onto its EndpointSlices: what a namespace-wide router selects.
                     "labels": {**child_labels(name), SERVERS_ENDPOINTS_LABEL: SERVERS_ENDPOINTS_VALUE}},
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(name),
            "ports": [{"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def build_children(name: str, namespace: str, spec: InferenceServiceSpec,
                   images: Images | None = None) -> list[dict[str, Any]]:
    """Everything applied on every reconcile (the generated Redis Secret is created once, apart)."""
    from kvscale.operator import redis_children, router_children

    images = images or Images()
    children = [
        build_deployment(name, namespace, spec),
        build_service(name, namespace, spec),
        build_headless_service(name, namespace),
    ]
    if spec.router.enabled:
        children += [
            *router_children.build_router_rbac(name, namespace),
            router_children.build_router_deployment(name, namespace, spec, images.router),
            router_children.build_router_pdb(name, namespace),
        ]
        if not spec.router.redis.external:
            children += [redis_children.build_redis_deployment(name, namespace, images.redis),
                         redis_children.build_redis_service(name, namespace)]
    return children


def unwanted_children(name: str, namespace: str, spec: InferenceServiceSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, plural, name) of optional children this spec no longer wants, to delete."""
    from kvscale.operator.redis_children import redis_name
    from kvscale.operator.router_children import router_name

    unwanted: list[tuple[str, str, str]] = []
    if not spec.router.enabled:
        router = router_name(name)
        unwanted += [("apps/v1", "deployments", router), ("policy/v1", "poddisruptionbudgets", router),
                     ("rbac.authorization.k8s.io/v1", "rolebindings", router),
                     ("rbac.authorization.k8s.io/v1", "roles", router), ("v1", "serviceaccounts", router)]
    if not spec.router.enabled or spec.router.redis.external:
        redis = redis_name(name)
        unwanted += [("apps/v1", "deployments", redis), ("v1", "services", redis), ("v1", "secrets", redis)]
    return unwanted
