"""Scraping each ready pod's /metrics for the numbers the scaling rule needs.

A pod is scraped at http://POD_IP:8000/metrics. With `kvscale operator
--allow-metrics-url-override` (or KVSCALE_ALLOW_METRICS_URL_OVERRIDE=1) a pod annotation
`serving.kvscale.io/metrics-url: http://host:port/metrics` replaces that address (on a router
pod, it also places the /health the operator reads beside it). It is off by
default because whoever may annotate pods could otherwise point the operator's requests anywhere;
it exists for clusters whose pods run no real server (kwok in the end-to-end tests) and for
sidecar-proxied metrics.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscale import metric_names as names
from kvscale.base_urls import base_url
from kvscale.operator.bounded_get import DEFAULT_MAX_BYTES, BoundExceeded, bounded_get
from kvscale.operator.scaling import PodLoad
from kvscale.operator.spec import SERVER_PORT

KV_BLOCKS_ACTIVE = names.KV_BLOCKS_ACTIVE.series
KV_BLOCKS_TOTAL = names.KV_BLOCKS_TOTAL.series
NUM_REQUESTS_WAITING = names.NUM_REQUESTS_WAITING.series
NUM_REQUESTS_RUNNING = names.NUM_REQUESTS_RUNNING.series
KV_BLOCKS_CACHED = names.KV_BLOCKS_CACHED.series
MAX_NUM_SEQS = names.MAX_NUM_SEQS.series
PREFILL_TOKENS_WAITING = names.PREFILL_TOKENS_WAITING.series
PREFILL_TOKENS_PER_S = names.PREFILL_TOKENS_PER_S.series
WANTED = (KV_BLOCKS_ACTIVE, KV_BLOCKS_TOTAL, NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING,
          KV_BLOCKS_CACHED, MAX_NUM_SEQS, PREFILL_TOKENS_WAITING, PREFILL_TOKENS_PER_S)
METRICS_URL_ANNOTATION = "serving.kvscale.io/metrics-url"


def is_ready(pod: dict[str, Any]) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def annotated_metrics_url(pod: dict[str, Any], allow_override: bool) -> str | None:
    """The pod's metrics-url annotation, when the operator was told to honour it."""
    if not allow_override:
        return None
    return (pod.get("metadata", {}).get("annotations") or {}).get(METRICS_URL_ANNOTATION) or None


def metrics_url(pod: dict[str, Any], allow_override: bool) -> str | None:
    override = annotated_metrics_url(pod, allow_override)
    if override:
        return override
    ip = (pod.get("status") or {}).get("podIP")
    return base_url(ip, SERVER_PORT) + "/metrics" if ip else None


def parse_metrics(text: str) -> dict[str, float]:
    """Sums of the wanted samples over their label sets (one per model, usually)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in WANTED:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    return sums


def scrape_pod(client: httpx.Client, pod_name: str, url: str | None, timeout: float = 2.0,
               max_bytes: int = DEFAULT_MAX_BYTES) -> PodLoad:
    if url is None:
        return PodLoad(pod=pod_name, error="no pod IP")
    try:
        status, body = bounded_get(client, url, max_bytes, timeout)
        if status >= 400:
            return PodLoad(pod=pod_name, error=f"HTTP {status}")
        values = parse_metrics(body.decode("utf-8", errors="replace"))
    except httpx.TimeoutException:
        return PodLoad(pod=pod_name, error="scrape timed out")
    except BoundExceeded as exc:
        return PodLoad(pod=pod_name, error=f"scrape refused: {exc}")
    except (httpx.HTTPError, ValueError) as exc:
        return PodLoad(pod=pod_name, error=f"scrape failed: {exc}")
    missing = [name for name in (KV_BLOCKS_ACTIVE, KV_BLOCKS_TOTAL) if name not in values]
    return PodLoad(
        pod=pod_name,
        kv_blocks_active=values.get(KV_BLOCKS_ACTIVE),
        kv_blocks_total=values.get(KV_BLOCKS_TOTAL),
        num_requests_waiting=values.get(NUM_REQUESTS_WAITING, 0.0),
        num_requests_running=values.get(NUM_REQUESTS_RUNNING, 0.0),
        kv_blocks_cached=values.get(KV_BLOCKS_CACHED, 0.0),
        max_num_seqs=values.get(MAX_NUM_SEQS),
        prefill_tokens_waiting=values.get(PREFILL_TOKENS_WAITING),
        prefill_tokens_per_s=values.get(PREFILL_TOKENS_PER_S),
        error=f"missing {', '.join(missing)}" if missing else "",
    )


def scrape_pods(pods: list[dict[str, Any]], timeout: float, allow_override: bool,
                max_bytes: int = DEFAULT_MAX_BYTES) -> list[PodLoad]:
    """Every ready pod's load, scraped in parallel so one slow pod costs one timeout, not N;
    each scrape bounded in bytes and in time as a whole (bounded_get.py)."""
    ready = [p for p in pods if is_ready(p)]
    if not ready:
        return []
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client, \
            ThreadPoolExecutor(max_workers=min(16, len(ready))) as pool:
        return list(pool.map(
            lambda pod: scrape_pod(client, pod["metadata"]["name"], metrics_url(pod, allow_override),
                                   timeout, max_bytes),
            ready))
