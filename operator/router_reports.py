"""What each ready router pod's /health says: of its tokenizers, folded into the `PrefixRouting`
condition (whether the routers route by prefix), and of its held requests and idle time, folded
into the autoscaler's `Demand` (scale from and to zero).

A router that cannot load its model's tokenizer keeps serving, by load alone; without this the
only sign would be a metric. The decision (`prefix_routing_condition`) is a pure function; the
reading (`read_router_reports`) asks each ready router pod, in parallel, with a short timeout.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscale.base_urls import base_url
from kvscale.operator.bounded_get import DEFAULT_MAX_BYTES, BoundExceeded, bounded_get
from kvscale.operator.conditions import Condition
from kvscale.operator.scaling import Demand
from kvscale.operator.scraping import annotated_metrics_url, is_ready
from kvscale.operator.spec import ROUTER_PORT

PREFIX_ROUTING = "PrefixRouting"
MAX_QUEUED = 100_000
# A server registers at most 256 adapters (server/worker/lora_manager.py); names longer than a
# registered one are no server's.
MAX_ADAPTERS = 256
MAX_ADAPTER_NAME = 256


@dataclass(frozen=True)
class RouterReport:
    pod: str
    missing: dict[str, str]  # served model name -> why its tokenizer did not load
    error: str = ""  # the pod could not be asked: its /health unreachable or not as expected
    held: int = 0  # requests it holds for a replica
    queued: int = 0  # requests waiting in its queue for room on a server (--max-queue-wait)
    idle_seconds: float | None = None  # since a request was last open or held there; None: unsaid
    last_cold_start_s: float | None = None  # its last wait from a held request to a ready replica
    last_cold_start_ago_s: float | None = None  # how long ago that wait ended
    indexed: dict[str, float] = field(default_factory=dict)  # replica id -> blocks its index holds
    # routable replica id -> its LoRA adapters (operator/adapter_status.py)
    adapters: dict[str, frozenset[str]] = field(default_factory=dict)


def report_from_health(pod: str, body: Any) -> RouterReport:
    if not isinstance(body, dict) or not isinstance(body.get("tokenizers"), list):
        return RouterReport(pod, {}, "its /health lists no tokenizers (an older router?)")
    missing = {str(t.get("model")): str(t.get("error") or "not loaded")
               for t in body["tokenizers"] if isinstance(t, dict) and not t.get("loaded")}
    indexed = {str(r["id"]): float(r["index_blocks"]) for r in body.get("replicas") or []
               if isinstance(r, dict) and isinstance(r.get("index_blocks"), (int, float))}
    adapters = {str(r["id"]): frozenset(str(n) for n in r["adapters"][:MAX_ADAPTERS]
                                        if isinstance(n, str) and len(n) <= MAX_ADAPTER_NAME)
                for r in body.get("replicas") or []
                if isinstance(r, dict) and "id" in r and r.get("healthy") is True
                and isinstance(r.get("adapters"), list)}
    said = body.get("queued")
    # A router's queue holds at most a few thousand; a larger figure is no router's.
    queued = min(said, MAX_QUEUED) if isinstance(said, int) and not isinstance(said, bool) and said > 0 else 0
    activation = body.get("activation")
    if not isinstance(activation, dict):
        return RouterReport(pod, missing, queued=queued, indexed=indexed, adapters=adapters)
    idle = activation.get("idle_seconds")
    cold = activation.get("last_cold_start_seconds")
    ago = activation.get("last_cold_start_ago_seconds")
    return RouterReport(pod, missing, held=int(activation.get("held") or 0), queued=queued,
                        idle_seconds=float(idle) if isinstance(idle, (int, float)) else None,
                        last_cold_start_s=float(cold) if isinstance(cold, (int, float)) else None,
                        last_cold_start_ago_s=float(ago) if isinstance(ago, (int, float)) and ago >= 0 else None,
                        indexed=indexed, adapters=adapters)


def indexed_blocks(reports: list[RouterReport]) -> dict[str, float]:
    """Blocks the routers' index holds per replica: the most any router holds (they all read
    the same Redis; one that just started has less)."""
    out: dict[str, float] = {}
    for report in reports:
        for replica, blocks in report.indexed.items():
            out[replica] = max(out.get(replica, 0.0), blocks)
    return out


def demand_from_reports(reports: list[RouterReport]) -> Demand:
    """Held requests summed; idle only as long as the least idle router, and unknown when any
    router did not say (it may be the one with traffic) or none is ready."""
    idle = [r.idle_seconds for r in reports]
    known = bool(reports) and all(i is not None and not r.error for i, r in zip(idle, reports, strict=True))
    return Demand(held=sum(r.held for r in reports),
                  idle_seconds=min(i for i in idle if i is not None) if known else None,
                  queued=sum(r.queued for r in reports))


def health_url(pod: dict[str, Any], allow_override: bool) -> str | None:
    """The router pod's /health: at its pod IP, or beside the address its metrics-url
    annotation gives (honoured only with --allow-metrics-url-override, as for the servers)."""
    override = annotated_metrics_url(pod, allow_override)
    if override:
        return override.removesuffix("/metrics") + "/health"
    ip = (pod.get("status") or {}).get("podIP")
    return base_url(ip, ROUTER_PORT) + "/health" if ip else None


def read_router_report(client: httpx.Client, pod: dict[str, Any], allow_override: bool,
                       timeout: float = 2.0, max_bytes: int = DEFAULT_MAX_BYTES) -> RouterReport:
    name = pod["metadata"]["name"]
    url = health_url(pod, allow_override)
    if url is None:
        return RouterReport(name, {}, "no pod IP")
    try:
        # 503 (no ready server yet) still carries the body.
        _status, body = bounded_get(client, url, max_bytes, timeout)
        return report_from_health(name, json.loads(body))
    except (httpx.HTTPError, BoundExceeded, ValueError) as exc:
        return RouterReport(name, {}, f"/health: {exc}")


def read_router_reports(pods: list[dict[str, Any]], timeout: float,
                        allow_override: bool = False,
                        max_bytes: int = DEFAULT_MAX_BYTES) -> list[RouterReport]:
    ready = [p for p in pods if is_ready(p)]
    if not ready:
        return []
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client, \
            ThreadPoolExecutor(max_workers=min(8, len(ready))) as pool:
        return list(pool.map(
            lambda pod: read_router_report(client, pod, allow_override, timeout, max_bytes), ready))


def prefix_routing_condition(reports: list[RouterReport]) -> Condition:
    """False when any router lacks a tokenizer; True when every router answered and has all;
    Unknown when no router could be asked."""
    lacking = [r for r in reports if r.missing]
    if lacking:
        details = "; ".join(f"{r.pod}: no tokenizer for {model} ({error})"
                            for r in lacking for model, error in sorted(r.missing.items()))
        return Condition(PREFIX_ROUTING, False, "TokenizerUnavailable",
                         f"requests are routed by load alone, without prefix-cache affinity: {details}")
    answered = [r for r in reports if not r.error]
    if not answered:
        reasons = "; ".join(f"{r.pod}: {r.error}" for r in reports) or "no router pod is ready"
        return Condition(PREFIX_ROUTING, None, "RoutersNotReporting", reasons)
    return Condition(PREFIX_ROUTING, True, "TokenizersLoaded",
                     f"{len(answered)} router pod(s) hash prompts with the servers' tokenizer")
