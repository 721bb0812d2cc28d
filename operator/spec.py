"""The InferenceService spec as typed values, with the CRD's defaults applied.

The API server already fills defaults from the CRD schema; applying them again here keeps the
builders and the scaling rule pure functions of plain dicts (and testable without a cluster).
`tests/operator/test_spec.py` checks that these defaults equal the CRD's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvscale.k8s_labels import (
    INFERENCE_SERVICE_GROUP,
    INFERENCE_SERVICE_PLURAL,
    INFERENCE_SERVICE_VERSION,
)
from kvscale.operator.server_memory import cpu_kv_cache_bytes

GROUP = INFERENCE_SERVICE_GROUP
VERSION = INFERENCE_SERVICE_VERSION
PLURAL = INFERENCE_SERVICE_PLURAL
KIND = "InferenceService"
NAME_LABEL = f"{GROUP}/inferenceservice"
# The engine image of an InferenceService without spec.image: `kvscale operator --engine-image`
# (the chart's images.engine) overrides it, so the spec leaves the field empty rather than
# defaulting it (and so does the CRD: an apiserver-filled default would pin it).
DEFAULT_IMAGE = "ghcr.io/kvscale/kvscale:0.1.0"
# The router runs from the slim control-plane image (no torch); the operator's flags override both.
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvscale/kvscale-control-plane:0.1.0"
DEFAULT_REDIS_IMAGE = "docker.io/library/redis:7.4.2"
SERVER_PORT = 8000
ROUTER_PORT = 8080
REDIS_PORT = 6379
# The endpoint picker's gRPC port (`kvscale router --ext-proc-port`): 9002, as GIE's pickers use.
EXT_PROC_PORT = 9002
FAIL_CLOSE = "FailClose"
MODEL_SCHEMES = ("bundled://", "hf://", "pvc://")
# Where a LoRA adapter may come from: the model's sources but the image (which ships none).
ADAPTER_SCHEMES = ("hf://", "pvc://")
MAX_NODES = 16  # engine.nodes, as the CRD bounds it


class SchemeUri:
    """The two halves of a source's ``uri`` (SCHEME://LOCATION)."""

    uri: str

    @property
    def scheme(self) -> str:
        return self.uri.split("://", 1)[0]

    @property
    def location(self) -> str:
        """The part after the scheme: NAME, ORG/NAME or CLAIM/PATH."""
        return self.uri.split("://", 1)[1]


@dataclass(frozen=True)
class ModelSource(SchemeUri):
    uri: str
    served_name: str


@dataclass(frozen=True)
class LoraAdapter(SchemeUri):
    """One of `spec.adapters` (docs/operator.md, "LoRA adapters"): the name clients send as
    `model`, and where its PEFT directory comes from (hf://ORG/NAME or pvc://CLAIM/PATH)."""

    name: str
    uri: str


def flag_name(arg: str) -> str:
    """``--no-x=1`` -> ``--x``: a switch and its negation are one flag."""
    name = arg.split("=", 1)[0]
    return "--" + name[len("--no-"):] if name.startswith("--no-") else name


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # LoRA (with spec.adapters): adapters resident at once, their largest rank, those kept in
    # host memory; None: the engine's default.
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    extra_args: tuple[str, ...] = ()
    # Nodes one replica spans (docs/operator.md, "A replica over several nodes"): more than one
    # runs resources.gpus ranks on each, through a LeaderWorkerSet.
    nodes: int = 1

    def extra_flag(self, flag: str) -> str | None:
        """The value extraArgs give ``flag`` (``--flag value`` or ``--flag=value``; the last
        one wins, as with argparse), or None."""
        value = None
        for i, arg in enumerate(self.extra_args):
            if arg == flag and i + 1 < len(self.extra_args):
                value = self.extra_args[i + 1]
            elif arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
        return value

    def sets(self, flag: str) -> bool:
        """Whether extraArgs set ``flag``, as itself or negated (``--no-x`` sets ``--x``)."""
        return any(flag_name(arg) == flag_name(flag) for arg in self.extra_args if arg.startswith("--"))


@dataclass(frozen=True)
class Resources:
    gpus: int = 1
    cpu: str = "2"
    memory: str = "8Gi"


@dataclass(frozen=True)
class AutoscalingPolicy:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_usage: float = 0.7
    target_queue_length: int = 8
    # Seconds of queued prompt work (prefill tokens waiting / the replica's measured prefill rate)
    # one more replica is worth: about the wait for a first token behind other prompts.
    target_prefill_seconds: float = 1.0
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    panic_window_seconds: int = 6
    panic_threshold: float = 2.0
    max_scale_up_rate: float = 2.0
    # With min_replicas 0: replicas go to zero once no request was open or held (on any router)
    # for this long.
    scale_to_zero_after_seconds: int = 300
    # How long a router holds a request while the service comes up from zero before answering
    # 503: longer than a replica's cold start (a model load; seconds for the bundled model,
    # minutes for a large one), shorter than the router's own upstream read timeout.
    activation_timeout_seconds: int = 120

    @property
    def scales_to_zero(self) -> bool:
        return self.enabled and self.min_replicas == 0


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str = "api-key"


@dataclass(frozen=True)
class TenantSpec:
    """One of `spec.router.tenants` (docs/operator.md, "Tenants"): the router's tenants file entry,
    its key named by a Secret the operator never reads."""

    name: str
    api_key_secret: SecretKeyRef
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    weight: float = 1.0
    priority: int = 0


@dataclass(frozen=True)
class RedisSource:
    """Where the router and the servers keep the KV index: the operator's own Redis unless
    `url` or `secret_ref` (a Secret key holding the whole URL) names an external one."""

    url: str | None = None
    secret_ref: SecretKeyRef | None = None

    @property
    def external(self) -> bool:
        return self.url is not None or self.secret_ref is not None


@dataclass(frozen=True)
class RouterResources:
    cpu: str = "1"
    memory: str = "1Gi"


@dataclass(frozen=True)
class InferencePoolSpec:
    """`spec.router.inferencePool` (docs/gateway.md, "From an InferenceService"): the routers
    also serve as a Gateway API Inference Extension endpoint picker, and an InferencePool names
    the servers and that picker to a gateway."""

    enabled: bool = False
    ext_proc_port: int = EXT_PROC_PORT
    failure_mode: str = FAIL_CLOSE  # or FailOpen: what the gateway does while no picker answers


@dataclass(frozen=True)
class RouterSpec:
    enabled: bool = True
    replicas: int = 2
    policy: str | None = None  # None: the router's own default
    # --balance-epsilon, None: the router's own default. predicted-ttft: the relative prediction error a
    # prefix's holder may show before a request spills; prefix-affinity: the bounded-load slack.
    balance_epsilon: float | None = None
    # --max-queue-wait: requests wait in the router while the servers have no room; None: off.
    max_queue_wait_s: float | None = None
    resources: RouterResources = field(default_factory=RouterResources)
    redis: RedisSource = field(default_factory=RedisSource)
    tenants: tuple[TenantSpec, ...] = ()
    inference_pool: InferencePoolSpec = field(default_factory=InferencePoolSpec)


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSource
    image: str = ""  # empty: the operator's engine image (Images.engine)
    engine: EngineConfig = field(default_factory=EngineConfig)
    resources: Resources = field(default_factory=Resources)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    replicas: int = 1
    autoscaling: AutoscalingPolicy = field(default_factory=AutoscalingPolicy)
    api_key_secret: SecretKeyRef | None = None
    router: RouterSpec = field(default_factory=RouterSpec)
    adapters: tuple[LoraAdapter, ...] = ()


def default_served_name(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def parse_spec(spec: dict[str, Any]) -> InferenceServiceSpec:
    """Typed spec from the resource's `spec` dict; raises ValueError on what the CRD would reject."""
    model = spec.get("model") or {}
    uri = model.get("uri")
    if not isinstance(uri, str) or not uri.startswith(MODEL_SCHEMES) or uri.endswith("://"):
        raise ValueError(f"model.uri must be bundled://NAME, hf://ORG/NAME or pvc://CLAIM/PATH, got {uri!r}")
    engine = spec.get("engine") or {}
    resources = spec.get("resources") or {}
    autoscaling = spec.get("autoscaling") or {}
    secret = spec.get("apiKeySecretRef")
    e, r, a = EngineConfig(), Resources(), AutoscalingPolicy()
    parsed = InferenceServiceSpec(
        model=ModelSource(uri=uri, served_name=model.get("servedName") or default_served_name(uri)),
        image=spec.get("image") or "",
        engine=EngineConfig(
            block_size=int(engine.get("blockSize", e.block_size)),
            max_num_seqs=int(engine.get("maxNumSeqs", e.max_num_seqs)),
            max_num_batched_tokens=_optional_int(engine.get("maxNumBatchedTokens")),
            max_model_len=_optional_int(engine.get("maxModelLen")),
            dtype=str(engine.get("dtype", e.dtype)),
            gpu_memory_utilization=float(engine.get("gpuMemoryUtilization", e.gpu_memory_utilization)),
            enable_prefix_caching=bool(engine.get("enablePrefixCaching", e.enable_prefix_caching)),
            max_loras=_optional_int(engine.get("maxLoras")),
            max_lora_rank=_optional_int(engine.get("maxLoraRank")),
            max_cpu_loras=_optional_int(engine.get("maxCpuLoras")),
            extra_args=tuple(str(arg) for arg in engine.get("extraArgs") or ()),
            nodes=int(engine.get("nodes", e.nodes)),
        ),
        resources=Resources(
            gpus=int(resources.get("gpus", r.gpus)),
            cpu=str(resources.get("cpu", r.cpu)),
            memory=str(resources.get("memory", r.memory)),
        ),
        node_selector=dict(spec.get("nodeSelector") or {}),
        tolerations=tuple(dict(t) for t in spec.get("tolerations") or ()),
        replicas=int(spec.get("replicas", 1)),
        autoscaling=AutoscalingPolicy(
            enabled=bool(autoscaling.get("enabled", a.enabled)),
            min_replicas=int(autoscaling.get("minReplicas", a.min_replicas)),
            max_replicas=int(autoscaling.get("maxReplicas", a.max_replicas)),
            target_kv_usage=float(autoscaling.get("targetKVUsage", a.target_kv_usage)),
            target_queue_length=int(autoscaling.get("targetQueueLength", a.target_queue_length)),
            target_prefill_seconds=float(
                autoscaling.get("targetPrefillSeconds", a.target_prefill_seconds)),
            scale_up_stabilization_seconds=int(
                autoscaling.get("scaleUpStabilizationSeconds", a.scale_up_stabilization_seconds)),
            scale_down_stabilization_seconds=int(
                autoscaling.get("scaleDownStabilizationSeconds", a.scale_down_stabilization_seconds)),
            panic_window_seconds=int(autoscaling.get("panicWindowSeconds", a.panic_window_seconds)),
            panic_threshold=float(autoscaling.get("panicThreshold", a.panic_threshold)),
            max_scale_up_rate=float(autoscaling.get("maxScaleUpRate", a.max_scale_up_rate)),
            scale_to_zero_after_seconds=int(
                autoscaling.get("scaleToZeroAfterSeconds", a.scale_to_zero_after_seconds)),
            activation_timeout_seconds=int(
                autoscaling.get("activationTimeoutSeconds", a.activation_timeout_seconds)),
        ),
        api_key_secret=(SecretKeyRef(name=secret["name"], key=secret.get("key") or "api-key")
                        if secret else None),
        router=parse_router(spec.get("router") or {}),
        adapters=parse_adapters(spec.get("adapters") or ()),
    )
    lora = (parsed.engine.max_loras, parsed.engine.max_lora_rank, parsed.engine.max_cpu_loras)
    if not parsed.adapters and any(value is not None for value in lora):
        raise ValueError("engine.maxLoras, engine.maxLoraRank and engine.maxCpuLoras need spec.adapters")
    if not 1 <= parsed.engine.nodes <= MAX_NODES:
        raise ValueError(f"engine.nodes must be in [1, {MAX_NODES}], got {parsed.engine.nodes}")
    if parsed.engine.nodes > 1 and parsed.resources.gpus < 1:
        # The ranks of other nodes are reached over NCCL: a CPU server's gloo ranks stay in one pod.
        raise ValueError("engine.nodes > 1 needs resources.gpus >= 1")
    if parsed.resources.gpus == 0:
        cpu_kv_cache_bytes(parsed.resources.memory)  # a limit the server cannot start in is refused
    if parsed.autoscaling.min_replicas == 0 and not parsed.router.enabled:
        # At zero replicas only the router is there to hold a request and wake the servers.
        raise ValueError("autoscaling.minReplicas 0 needs the router (router.enabled: true)")
    if parsed.router.tenants and (parsed.api_key_secret is None or not parsed.router.enabled):
        # The servers trust the router's tenant header only behind their own key (docs/server.md,
        # "Tenants"), and only the router reads the tenants.
        raise ValueError("router.tenants needs the router and apiKeySecretRef (the servers' key)")
    if parsed.router.inference_pool.enabled and not parsed.router.enabled:
        # The routers are the endpoint picker; with a key or tenants the picker checks them as the
        # HTTP port does (docs/gateway.md, "What the picker does").
        raise ValueError("router.inferencePool needs the router (router.enabled: true)")
    return parsed


def parse_adapters(adapters: Any) -> tuple[LoraAdapter, ...]:
    """spec.adapters; ValueError for a source no pod can read them from or a repeated name."""
    parsed = tuple(LoraAdapter(name=str(a["name"]), uri=str(a["uri"])) for a in adapters)
    for adapter in parsed:
        if (not adapter.uri.startswith(ADAPTER_SCHEMES) or "/" not in adapter.location.strip("/")
                or {".", ".."} & set(adapter.location.split("/"))):
            raise ValueError(f"adapters[{adapter.name}].uri must be hf://ORG/NAME or "
                             f"pvc://CLAIM/PATH without . or .. segments, got {adapter.uri!r}")
    names = [a.name for a in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"adapters name {sorted({n for n in names if names.count(n) > 1})} "
                         "more than once")
    return parsed


def parse_router(router: dict[str, Any]) -> RouterSpec:
    defaults, resource_defaults = RouterSpec(), RouterResources()
    redis = router.get("redis") or {}
    secret = redis.get("secretRef")
    url = redis.get("url")
    if url is not None and secret is not None:
        raise ValueError("router.redis takes url or secretRef, not both")
    if url is not None and not str(url).startswith(("redis://", "rediss://")):
        raise ValueError(f"router.redis.url must start with redis:// or rediss://, got {url!r}")
    resources = router.get("resources") or {}
    epsilon = router.get("balanceEpsilon")
    wait = router.get("maxQueueWaitSeconds")
    if wait is not None and not 0 < float(wait) <= 3600:
        raise ValueError(f"router.maxQueueWaitSeconds must be in (0, 3600], got {wait!r}")
    return RouterSpec(
        enabled=bool(router.get("enabled", defaults.enabled)),
        replicas=int(router.get("replicas", defaults.replicas)),
        policy=router.get("policy"),
        balance_epsilon=None if epsilon is None else float(epsilon),
        max_queue_wait_s=None if wait is None else float(wait),
        resources=RouterResources(cpu=str(resources.get("cpu", resource_defaults.cpu)),
                                  memory=str(resources.get("memory", resource_defaults.memory))),
        redis=RedisSource(
            url=None if url is None else str(url),
            secret_ref=(SecretKeyRef(name=secret["name"], key=secret.get("key") or "url")
                        if secret else None),
        ),
        tenants=tuple(parse_tenant(t) for t in router.get("tenants") or ()),
        inference_pool=parse_inference_pool(router.get("inferencePool") or {}),
    )


def parse_inference_pool(pool: dict[str, Any]) -> InferencePoolSpec:
    defaults = InferencePoolSpec()
    parsed = InferencePoolSpec(
        enabled=bool(pool.get("enabled", defaults.enabled)),
        ext_proc_port=int(pool.get("extProcPort", defaults.ext_proc_port)),
        failure_mode=str(pool.get("failureMode", defaults.failure_mode)),
    )
    if parsed.ext_proc_port == ROUTER_PORT or not 1 <= parsed.ext_proc_port <= 65535:
        raise ValueError(f"router.inferencePool.extProcPort must be a port other than {ROUTER_PORT}")
    if parsed.failure_mode not in ("FailOpen", FAIL_CLOSE):
        raise ValueError("router.inferencePool.failureMode must be FailOpen or FailClose")
    return parsed


def parse_tenant(tenant: dict[str, Any]) -> TenantSpec:
    ref = tenant["apiKeySecretRef"]
    return TenantSpec(
        name=str(tenant["name"]),
        api_key_secret=SecretKeyRef(name=ref["name"], key=ref.get("key") or "api-key"),
        requests_per_minute=_optional_int(tenant.get("requestsPerMinute")),
        tokens_per_minute=_optional_int(tenant.get("tokensPerMinute")),
        weight=float(tenant.get("weight", 1.0)),
        priority=int(tenant.get("priority", 0)),
    )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
