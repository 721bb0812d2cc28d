"""A `kvscale router` Deployment with its own ServiceAccount, Role, RoleBinding and
PodDisruptionBudget, built from a `RouterPod`.

Two routers are made from it: the one in front of each InferenceService's servers (finding them
through the EndpointSlices of the servers' headless Service; `service_router`) and the chart's
namespace-wide router (`namespace_router`), which `kvscale operator render-router` prints. Both
pods are therefore the same but for what a `RouterPod` says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscale.operator.children.inference_pool import ext_proc_container_port, ext_proc_port
from kvscale.operator.children.labels import (
    headless_service_name,
    router_labels,
    router_name,
    router_selector,
)
from kvscale.operator.children.model_files import ModelFiles, model_files
from kvscale.operator.children.pod_parts import (
    REPLICA_API_KEY_ENV,
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
from kvscale.operator.children.tenants import (
    tenants_args,
    tenants_env,
    tenants_mount,
    tenants_volume,
)
from kvscale.operator.lora_adapters import RUNTIME_UPDATES_FLAG
from kvscale.operator.spec import GROUP, PLURAL, ROUTER_PORT, InferenceServiceSpec, SecretKeyRef

# Routers hold open streams: time for them to finish after SIGTERM.
ROUTER_TERMINATION_GRACE_PERIOD_SECONDS = 60
READ = ["get", "list", "watch"]
# The servers' addresses and readiness: all a router reads to find one InferenceService's servers.
ENDPOINTSLICES_RULE: dict[str, Any] = {
    "apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": READ}


@dataclass(frozen=True)
class RouterPod:
    """What a router's objects are made of. Fields typed `int | str` take a Helm expression in
    the chart's template (`render-router --helm`); `container_extras` and `pod_extras` are fields
    only the chart sets (pull policy and secrets, scheduling)."""

    name: str  # of every object
    namespace: str
    labels: Mapping[str, str]
    selector: Mapping[str, str]
    image: str
    replicas: int | str
    discovery: tuple[str, ...]  # the flags saying which servers it routes to
    rules: tuple[Mapping[str, Any], ...]  # what its Role may read
    resources: Mapping[str, Any]
    env: tuple[EnvVar, ...] = ()  # the index's URL and the API keys, after the pod's own
    policy: str | None = None  # None: the router's default
    balance_epsilon: float | None = None
    max_queue_wait_s: float | None = None  # --max-queue-wait; None: off
    annotations: Mapping[str, str] = field(default_factory=dict)  # besides the scrape ones
    # The servers' model names and the tokenizer they use (where the pod finds it), so that
    # the router hashes prompts as they do; empty: the bundled model under its own name.
    tokenizer_args: tuple[str, ...] = ()
    model_files: ModelFiles = field(default_factory=lambda: ModelFiles(None))
    # Scale from zero (autoscaling.minReplicas 0): hold requests this long while no server is
    # ready, and raise the scale of this InferenceService from 0 (`kvscale router
    # --hold-timeout --scale-from-zero`); its Role then may get and patch that scale alone.
    hold_timeout_s: int | None = None
    scale_from_zero: str | None = None
    # The InferenceService whose tenants ConfigMap the router reads (`--tenants`); None: none.
    tenants_of: str | None = None
    # `--ext-proc-port`: the routers also serve as the InferencePool's endpoint picker
    # (docs/gateway.md, "From an InferenceService"); None: no picker.
    ext_proc_port: int | None = None
    # The servers load LoRA adapters at run time (their --allow-runtime-lora-updating): the router
    # passes a load on to every one of them and loads it again onto those that start later, and
    # holds a request naming it at zero replicas (docs/router.md, "Loading adapters at run time").
    runtime_lora_updates: bool = False
    container_extras: Mapping[str, Any] = field(default_factory=dict)
    pod_extras: Mapping[str, Any] = field(default_factory=dict)


def scale_rule(name: str) -> dict[str, Any]:
    """The one write a router may make: its own InferenceService's scale, 0 to 1."""
    return {"apiGroups": [GROUP], "resources": [f"{PLURAL}/scale"], "resourceNames": [name],
            "verbs": ["get", "patch"]}


def router_api_key_env(ref: SecretKeyRef | None) -> list[EnvVar]:
    """Clients send the key to the router, and the router sends it on to the servers."""
    return api_key_env(ref) + api_key_env(ref, REPLICA_API_KEY_ENV)


def service_router(name: str, namespace: str, spec: InferenceServiceSpec, image: str) -> RouterPod:
    """The router in front of the InferenceService `name`'s servers."""
    router = spec.router
    files = model_files(spec, image, for_router=True)
    tokenizer_args: tuple[str, ...] = ("--served-model-name", spec.model.served_name,
                      "--block-size", str(spec.engine.block_size))
    if files.path is not None:
        tokenizer_args = ("--model", files.path, *tokenizer_args)
    # Agents' prompts carry tools, which the servers render in their tool-call format.
    tool_format = spec.engine.extra_flag("--tool-call-parser")
    if tool_format is not None:
        tokenizer_args = (*tokenizer_args, "--tool-call-parser", tool_format)
    # At zero replicas a request naming one of the adapters is held and wakes the servers.
    if spec.adapters:
        tokenizer_args = (*tokenizer_args, "--lora-adapter-names", *(a.name for a in spec.adapters))
    # Under the servers' priority policy the router sends each tenant's priority with its requests.
    scheduling = spec.engine.extra_flag("--scheduling-policy")
    if scheduling is not None:
        tokenizer_args = (*tokenizer_args, "--scheduling-policy", scheduling)
    to_zero = spec.autoscaling.scales_to_zero
    tenants = router.tenants
    # With tenants, clients send their tenant's key (--tenants and --api-key are exclusive): the
    # service's key goes to the servers only, as the replicas' key.
    keys = ([*api_key_env(spec.api_key_secret, REPLICA_API_KEY_ENV), *tenants_env(tenants)]
            if tenants else router_api_key_env(spec.api_key_secret))
    return RouterPod(
        name=router_name(name),
        namespace=namespace,
        labels=router_labels(name),
        selector=router_selector(name),
        image=image,
        replicas=router.replicas,
        discovery=("--k8s-service", headless_service_name(name), "--namespace", "$(POD_NAMESPACE)",
                   "--k8s-port-name", "http"),
        rules=(ENDPOINTSLICES_RULE, *([scale_rule(name)] if to_zero else [])),
        resources={"requests": {"cpu": router.resources.cpu, "memory": router.resources.memory},
                   "limits": {"memory": router.resources.memory}},
        env=(*service_redis_env(name, namespace, spec), *keys),
        policy=router.policy,
        balance_epsilon=router.balance_epsilon,
        max_queue_wait_s=router.max_queue_wait_s,
        tokenizer_args=tokenizer_args,
        model_files=files,
        hold_timeout_s=spec.autoscaling.activation_timeout_seconds if to_zero else None,
        scale_from_zero=name if to_zero else None,
        tenants_of=name if tenants else None,
        ext_proc_port=ext_proc_port(spec),
        # Not with tenants: any tenant's key would then load paths onto every server.
        runtime_lora_updates=RUNTIME_UPDATES_FLAG in spec.engine.extra_args and not tenants,
    )


def router_args(pod: RouterPod) -> list[str]:
    """`kvscale router` flags; the Redis URL and keys come from the environment."""
    args = [
        "router",
        "--port", str(ROUTER_PORT),
        *pod.discovery,
        *pod.tokenizer_args,
        "--shutdown-timeout", str(shutdown_timeout(ROUTER_TERMINATION_GRACE_PERIOD_SECONDS)),
    ]
    if pod.policy is not None:
        args += ["--policy", pod.policy]
    if pod.balance_epsilon is not None:
        args += ["--balance-epsilon", str(pod.balance_epsilon)]
    if pod.max_queue_wait_s is not None:
        args += ["--max-queue-wait", str(pod.max_queue_wait_s)]
    if pod.hold_timeout_s is not None:
        args += ["--hold-timeout", str(pod.hold_timeout_s)]
    if pod.scale_from_zero is not None:
        args += ["--scale-from-zero", pod.scale_from_zero]
    if pod.tenants_of is not None:
        args += tenants_args()
    if pod.ext_proc_port is not None:
        args += ["--ext-proc-port", str(pod.ext_proc_port)]
    if pod.runtime_lora_updates:
        args.append(RUNTIME_UPDATES_FLAG)
    return args


def router_env(pod: RouterPod) -> list[EnvVar]:
    return [
        *field_env("POD_NAMESPACE"),  # --namespace's default
        # A writable home on a read-only root, and the bundled tokenizer from the image's cache.
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        *pod.env,
    ]


def router_container(pod: RouterPod) -> dict[str, Any]:
    return {
        "name": "router",
        "image": pod.image,
        **pod.container_extras,
        "command": ["kvscale"],
        "args": router_args(pod),
        "ports": [http_port(ROUTER_PORT),
                  *([ext_proc_container_port(pod.ext_proc_port)] if pod.ext_proc_port else [])],
        "env": router_env(pod),
        "resources": dict(pod.resources),
        # /health is 503 while no server is ready: right for readiness, wrong for liveness, which
        # asks /ping: answered by the event loop, so a wedged loop fails it (a TCP probe would
        # pass, the kernel accepting for it).
        "readinessProbe": http_probe(2, 2, timeout=2),
        "livenessProbe": http_probe(10, 3, timeout=5, path="/ping"),
        "lifecycle": pre_stop(),
        "securityContext": container_security_context(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *pod.model_files.mounts,
                         *([tenants_mount()] if pod.tenants_of is not None else [])],
    }


def build_router_deployment(pod: RouterPod) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)},
        "spec": {
            "replicas": pod.replicas,
            "selector": {"matchLabels": dict(pod.selector)},
            "strategy": rolling_update(),
            "template": {
                "metadata": {"labels": dict(pod.labels),
                             "annotations": {**scrape_annotations(ROUTER_PORT), **pod.annotations}},
                "spec": {
                    "serviceAccountName": pod.name,
                    "securityContext": pod_security_context(),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_PERIOD_SECONDS,
                    "topologySpreadConstraints": topology_spread(dict(pod.selector)),
                    **pod.pod_extras,
                    **({"initContainers": pod.model_files.init_containers}
                       if pod.model_files.init_containers else {}),
                    "containers": [router_container(pod)],
                    "volumes": [{"name": "tmp", "emptyDir": {}}, *pod.model_files.volumes,
                                *([tenants_volume(pod.tenants_of)] if pod.tenants_of else [])],
                },
            },
        },
    }


def build_router_pdb(pod: RouterPod) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(pod.selector)}},
    }


def build_router_rbac(pod: RouterPod) -> list[dict[str, Any]]:
    """Its own ServiceAccount, allowed only to read what it routes by."""
    def meta() -> dict[str, Any]:
        return {"name": pod.name, "namespace": pod.namespace, "labels": dict(pod.labels)}

    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta()},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": meta(),
            "rules": [dict(rule) for rule in pod.rules],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta(),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": pod.name},
            "subjects": [{"kind": "ServiceAccount", "name": pod.name, "namespace": pod.namespace}],
        },
    ]
