"""The servers of an InferenceService: the `kvscale serve` Deployment, the Service named like the
InferenceService (its OpenAI URL) and the headless Service the routers discover the servers from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvscale.k8s_labels import SERVERS_ENDPOINTS_LABEL, SERVERS_ENDPOINTS_VALUE
from kvscale.operator.children.inference_pool import pool_wanted
from kvscale.operator.children.labels import (
    CLIENT_FACING_LABEL,
    INFERENCE_POOL_LABEL,
    child_labels,
    headless_service_name,
    router_selector,
    selector_labels,
)
from kvscale.operator.children.model_files import MODEL_VOLUME_PATH, ModelFiles, model_files
from kvscale.operator.children.pod_parts import (
    EnvVar,
    api_key_env,
    container_security_context,
    field_env,
    http_port,
    http_probe,
    pod_security_context,
    pre_stop,
    rolling_update,
    scrape_annotations,
    shutdown_timeout,
    topology_spread,
)
from kvscale.operator.children.redis import service_redis_env
from kvscale.operator.lora_adapters import adapter_files, lora_args, spec_flags
from kvscale.operator.server_memory import cpu_kv_cache_bytes
from kvscale.operator.spec import SERVER_PORT, InferenceServiceSpec, flag_name
from kvscale.operator.tensor_parallel import (
    MULTI_NODE_FLAGS,
    shm_size_limit,
    tensor_parallel_args,
)

# Model load (and the bundled model's one-time conversion) can take minutes: the startup probe
# allows 30 minutes before liveness takes over. Probed every second: a replica coming up from
# zero (docs/operator.md "Scale to and from zero") is held-for by waiting requests, and a longer
# period would add up to a period to every cold start; a refused connect costs nothing.
STARTUP_PROBE_PERIOD_SECONDS = 1
STARTUP_PROBE_FAILURES = 1800
# Time for in-flight streams to finish after SIGTERM before the kubelet kills the server.
TERMINATION_GRACE_PERIOD_SECONDS = 60
# Flags a platform-wide server default may not set: those server_args sets from the spec or the
# pod (a default would lose to them, or fight them), those the CRD keeps out of engine.extraArgs
# (--host: the probes and Services need every address), and the Redis URL and the API key,
# which come from the spec through the environment and must not sit in the args.
RESERVED_FLAGS = frozenset({
    "--model", "--served-model-name", "--port", "--host", "--api-key", "--redis", "--replica-id",
    "--dtype", "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
    "--gpu-memory-utilization", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--kv-cache-memory-bytes", "--shutdown-timeout", "--tensor-parallel-size", *MULTI_NODE_FLAGS,
})
# The operator cannot import the server's parser (the parts stay independent, and the operator's
# image has no engine), so a default is checked for its shape: a lowercase long flag.
_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
_SHORT_FLAG = re.compile(r"-[A-Za-z]")


def server_default_flags(args: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """``args`` (as a container's args: ``--name=value``, ``--name value`` or a bare switch)
    grouped one flag each; ValueError for a value with no flag before it, something that is no
    long flag, or a flag the operator sets itself."""
    flags: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or _SHORT_FLAG.match(arg):  # not "-1": a negative value
            if not _FLAG.fullmatch(arg.split("=", 1)[0]):
                raise ValueError(f"{arg!r} is not a `kvscale serve` flag (--name, --name=value)")
            if arg.split("=", 1)[0] in RESERVED_FLAGS or flag_name(arg) in RESERVED_FLAGS:
                raise ValueError(f"{arg.split('=', 1)[0]} is set by the operator itself, from "
                                 "each InferenceService's spec and pod (docs/operator.md)")
            flags.append([arg])
        elif flags and len(flags[-1]) == 1 and "=" not in flags[-1][0]:
            flags[-1].append(arg)
        else:
            raise ValueError(f"{arg!r} follows no flag that takes it as its value")
    return tuple(tuple(flag) for flag in flags)


def with_server_defaults(spec: InferenceServiceSpec,
                         server_defaults: Sequence[Sequence[str]]) -> InferenceServiceSpec:
    """``spec`` with the platform's defaults (``server_default_flags``' groups) before its
    engine.extraArgs, less those of a flag extraArgs sets: dropped rather than passed twice, so
    the InferenceService's own value is the only one its server sees. Folded into the spec, so
    the router reads the flags the servers run with (--tool-call-parser) as it reads extraArgs.
    A default for a LoRA flag spec.adapters sets is dropped too: the spec's value stands."""
    own = spec_flags(spec)
    kept = [arg for group in server_defaults
            if not spec.engine.sets(group[0]) and flag_name(group[0]) not in own for arg in group]
    return replace(spec, engine=replace(spec.engine, extra_args=(*kept, *spec.engine.extra_args)))


def cpu_kv_cache_args(spec: InferenceServiceSpec) -> list[str]:
    """--kv-cache-memory-bytes for a server without a GPU, sized to its memory limit with both
    of its processes counted (operator/server_memory.py), unless engine.extraArgs sets it."""
    if spec.resources.gpus > 0 or spec.engine.sets("--kv-cache-memory-bytes"):
        return []
    return ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(spec.resources.memory))]


def server_args(spec: InferenceServiceSpec, model_path: str | None,
                rank_args: Sequence[str] = ()) -> list[str]:
    """`kvscale serve` flags, spelled as vLLM spells them; ``rank_args``: where this pod's ranks
    sit in a replica over several nodes (children/leader_worker_set.py)."""
    engine = spec.engine
    args = ["serve"]
    if model_path is not None:
        args += ["--model", model_path]
    args += [
        "--served-model-name", spec.model.served_name,
        # No --host: every address of the pod (localhost for port-forward and exec too); the
        # heartbeats name the pod IP, from POD_IP below.
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
    args += cpu_kv_cache_args(spec)
    args += tensor_parallel_args(spec)
    args += rank_args
    args += lora_args(spec)  # before a flag of ours: --lora-modules takes values up to the next
    args.append("--enable-prefix-caching" if engine.enable_prefix_caching
                else "--no-enable-prefix-caching")
    if spec.router.enabled:
        # The Redis URL comes from $KVSCALE_REDIS_URL, the API key from $KVSCALE_API_KEY:
        # secrets never sit in the args.
        args += ["--replica-id", "$(POD_NAME)"]
    return args + list(engine.extra_args)


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": spec.resources.cpu, "memory": spec.resources.memory}
    # No CPU limit: throttling the engine loop hurts latency more than it protects neighbours.
    limits: dict[str, Any] = {"memory": spec.resources.memory}
    if spec.resources.gpus > 0:
        requests["nvidia.com/gpu"] = spec.resources.gpus
        limits["nvidia.com/gpu"] = spec.resources.gpus
    return {"requests": requests, "limits": limits}


def cpu_threads(cpu: str) -> int:
    """The engine core's threads for a CPU quantity ("2", "1500m", "0.5"): its ceiling, at least 1."""
    text = cpu.strip()
    cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(1, math.ceil(cores - 1e-9))


def cpu_thread_env(spec: InferenceServiceSpec) -> list[EnvVar]:
    """OMP_NUM_THREADS on a CPU server, from its CPU request: the pod has no CPU limit (above)
    and its affinity mask is the whole node's, so neither tells the engine how many threads to
    run; this caps them and leaves them unpinned (server/engine/cpu_binding.py, docs/deploy.md
    "CPU threads"). A GPU server's threads only feed the GPU: torch's own count stays."""
    if spec.resources.gpus > 0:
        return []
    return [{"name": "OMP_NUM_THREADS", "value": str(cpu_threads(spec.resources.cpu))}]


def server_env(name: str, namespace: str, spec: InferenceServiceSpec) -> list[EnvVar]:
    # KVSCALE_CACHE is left to the image, which ships the bundled model converted (Dockerfile).
    env: list[EnvVar] = [
        {"name": "HF_HOME", "value": f"{MODEL_VOLUME_PATH}/hf-home"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "HOME", "value": "/tmp"},
        *field_env("POD_IP", "POD_NAME", "POD_NAMESPACE"),
        *cpu_thread_env(spec),
    ]
    if spec.router.enabled:
        env += service_redis_env(name, namespace, spec)
    return env + api_key_env(spec.api_key_secret)


def volumes_and_mounts(files: ModelFiles, spec: InferenceServiceSpec
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        *files.volumes,
        {"name": "tmp", "emptyDir": {}},
        # Shared memory for the engine's processes (its tensor-parallel ranks too, one share
        # each); the container runtime's default 64 MiB is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(spec)}},
    ]
    mounts: list[dict[str, Any]] = [
        *files.mounts,
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    return volumes, mounts


def server_container(name: str, namespace: str, spec: InferenceServiceSpec,
                     model_path: str | None, mounts: list[dict[str, Any]],
                     rank_args: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "name": "server",
        "image": spec.image,
        "command": ["kvscale"],
        "args": server_args(spec, model_path, rank_args),
        "ports": [http_port(SERVER_PORT)],
        "env": server_env(name, namespace, spec),
        "resources": container_resources(spec),
        "startupProbe": http_probe(STARTUP_PROBE_PERIOD_SECONDS, STARTUP_PROBE_FAILURES),
        "readinessProbe": http_probe(5, 3),
        "livenessProbe": http_probe(10, 6),
        "lifecycle": pre_stop(),
        "securityContext": container_security_context(),
        "volumeMounts": mounts,
    }


def server_pod_template(name: str, namespace: str, spec: InferenceServiceSpec,
                        rank_args: Sequence[str] = ()) -> dict[str, Any]:
    """The pod template of a server (a replica's leader over several nodes): its container
    named `server`, first."""
    files = adapter_files(spec, model_files(spec, spec.image))
    model_path, init_containers = files.path, files.init_containers
    volumes, mounts = volumes_and_mounts(files, spec)
    labels: dict[str, str] = child_labels(name)
    # Without a router the servers are the InferenceService's OpenAI endpoint: say so where
    # NetworkPolicies can see it (on the pods, not the Deployment's immutable selector).
    pod_labels = labels if spec.router.enabled else {**labels, CLIENT_FACING_LABEL: "true"}
    if pool_wanted(spec):
        # A gateway reaches these servers directly; the label lets NetworkPolicies admit it here
        # and not to every server of the namespace.
        pod_labels = {**pod_labels, INFERENCE_POOL_LABEL: "true"}
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        # The server needs no API access; the operator and the router have their own accounts.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_PERIOD_SECONDS,
        "topologySpreadConstraints": topology_spread(selector_labels(name)),
        "containers": [server_container(name, namespace, spec, model_path, mounts, rank_args)],
        "volumes": volumes,
    }
    if init_containers:
        pod_spec["initContainers"] = init_containers
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    return {"metadata": {"labels": pod_labels, "annotations": scrape_annotations(SERVER_PORT)},
            "spec": pod_spec}


def build_deployment(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "labels": child_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": rolling_update(),
            "template": server_pod_template(name, namespace, spec),
        },
    }


def build_server_pdb(name: str, namespace: str, selector: dict[str, str] | None = None) -> dict[str, Any]:
    """A voluntary disruption (a node drain) takes at most one server at a time: the others
    keep serving and keep their warm caches. At one replica (or zero) it blocks nothing.
    ``selector``: the pods counted, the servers' by default (every rank of a replica over
    several nodes: one pod evicted restarts its group)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": namespace, "labels": child_labels(name)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector or selector_labels(name)}},
    }


def build_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The service's OpenAI URL: the router pods when a router runs, else the servers."""
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
