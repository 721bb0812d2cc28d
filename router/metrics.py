"""The router's Prometheus metrics (names under `kvscale_router_`, from kvscale/metric_names.py),
and the pure rule that says when a decision was a bounded-load spill."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscale import metric_names as names

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
HIT_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class RouterMetrics:
    def __init__(self, policy: str = "prefix-affinity") -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def make(cls, metric: names.Metric, **kwargs):
            return cls(metric.name, metric.help, list(metric.labels), registry=r, **kwargs)

        self.requests = make(Counter, names.ROUTER_REQUESTS)
        self.decision_seconds = make(Histogram, names.ROUTER_DECISION_SECONDS,
                                     buckets=DECISION_BUCKETS)
        self.predicted_hit_tokens = make(Counter, names.ROUTER_PREDICTED_HIT_TOKENS)
        self.predicted_hit_tokens_per_request = make(
            Histogram, names.ROUTER_PREDICTED_HIT_TOKENS_PER_REQUEST, buckets=HIT_TOKEN_BUCKETS)
        self.prompt_tokens = make(Counter, names.ROUTER_PROMPT_TOKENS)
        self.spills = make(Counter, names.ROUTER_SPILLS)
        self.retries = make(Counter, names.ROUTER_RETRIES)
        self.fallbacks = make(Counter, names.ROUTER_FALLBACKS)
        self.redis_errors = make(Counter, names.ROUTER_REDIS_ERRORS)
        self.redis_up = make(Gauge, names.ROUTER_REDIS_UP)
        self.replicas_healthy = make(Gauge, names.ROUTER_REPLICAS_HEALTHY)
        self.in_flight = make(Gauge, names.ROUTER_IN_FLIGHT)
        self.index_blocks = make(Gauge, names.ROUTER_INDEX_BLOCKS)
        # Zero-valued series from the start: rate() needs two samples, and a dashboard panel or an
        # alert on a reason that has not happened yet should read 0, not "No data".
        for reason in names.ROUTER_RETRY_REASONS:
            self.retries.labels(reason)
        for reason in names.ROUTER_FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for status in ("502", "503"):
            self.requests.labels("none", policy, status)


def is_spill(matched_blocks: dict[str, int], chosen: str, reason: str) -> bool:
    """The chosen replica holds fewer of the prompt's blocks than the best holder: the policy
    passed the cache over for load (the bound, or the score's load term), so the prefix is
    computed again. A sticky session's choice is the client's, not a spill."""
    best = max(matched_blocks.values(), default=0)
    return reason != "sticky" and best > 0 and matched_blocks.get(chosen, 0) < best
