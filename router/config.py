"""What one router process is told to do: `kvscale router`'s flags, as one dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvscale.router.activation import DEFAULT_HOLD_QUEUE
from kvscale.router.admission import DEFAULT_BODY_BUDGET_BYTES, DEFAULT_MAX_OPEN_REQUESTS
from kvscale.router.chat_tokens import DEFAULT_MAX_TOKENS
from kvscale.router.policy import DEFAULT_POLICY, TTFT_EPSILON

if TYPE_CHECKING:
    from kvscale.router.tenants import TenantFile


@dataclass
class RouterConfig:
    replicas: list[str] = field(default_factory=list)
    k8s_service: str | None = None
    k8s_namespace_wide: bool = False  # every InferenceService's servers in `namespace`
    namespace: str = "default"
    k8s_port_name: str | None = None
    policy: str = DEFAULT_POLICY
    redis_url: str | None = None
    redis_timeout_ms: float = 50.0
    api_key: str | None = None
    # --tenants FILE, loaded (docs/router.md, "Tenants"): a key per tenant instead of api_key.
    tenants: TenantFile | None = None
    # Bounds checked from a request's head, before its body is read (router/admission.py).
    max_open_requests: int = DEFAULT_MAX_OPEN_REQUESTS
    body_budget_bytes: int = DEFAULT_BODY_BUDGET_BYTES
    replica_api_key: str | None = None
    block_size: int = 16
    models: list[str | None] = field(default_factory=lambda: [None])  # tokenizers to load
    served_model_names: list[str] = field(default_factory=list)  # the one model's names; []: its own
    # The servers' --lora-modules names: at zero replicas a request naming one is held (wakes them).
    lora_adapter_names: list[str] = field(default_factory=list)
    session_header: str | None = "x-session-id"
    epsilon: float = 0.25
    ttft_epsilon: float | None = TTFT_EPSILON  # predicted-ttft's load cap; None: off
    # predicted-ttft decides on its estimate corrected by the TTFTs measured here (off: the
    # correction is only reported; in simulation it spread work under eviction churn)
    ttft_calibration: bool = False
    max_attempts: int = 3
    health_interval_s: float = 2.0
    connect_timeout_s: float = 2.0
    seed: int | None = None
    freeze_heap_after_start: bool = False  # the CLI sets it; tests that build many apps do not
    chat_cache_tokens: int = DEFAULT_MAX_TOKENS  # chat prompts' token ids kept across turns; 0: off
    tool_call_parser: str = "hermes"  # the servers' --tool-call-parser: how prompts render tools
    # Scale from zero: hold requests while no replica is ready (None: answer 503 at once), at
    # most hold_queue of them, and raise this InferenceService's scale from 0 (None: wait for the
    # operator to).
    hold_timeout_s: float | None = None
    hold_queue: int = DEFAULT_HOLD_QUEUE
    scale_from_zero: str | None = None
    # Generation requests wait in the router while their replicas have no room, at most this
    # long, leaving by priority band, then weighted fair share (router/fair_queue.py; None: off).
    max_queue_wait_s: float | None = None
    # The replicas' --scheduling-policy: under "priority" a tenant's priority is sent as each of
    # its requests' priority field (router/engine_priority.py).
    scheduling_policy: str = "fcfs"
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter passed on to every replica
    # (router/lora_fanout.py); off: 404, as on a server without the flag.
    allow_runtime_lora_updating: bool = False
