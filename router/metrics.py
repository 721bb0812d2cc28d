"""The router's Prometheus metrics (names under `kvscale_router_`, from kvscale/metric_names.py),
and the pure rule that says when a decision was a bounded-load spill."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvscale import metric_names as names
from kvscale.metric_registry import register

DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1)
HIT_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Holds and cold starts: from a replica already coming up (sub-second) to a large model's load.
HOLD_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
# Waits in the router's queue: a slot freeing within a batch's step up to --max-queue-wait.
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self, policy: str = "prefix-affinity") -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        self.requests: Counter = register(names.ROUTER_REQUESTS, r)
        self.decision_seconds: Histogram = register(
            names.ROUTER_DECISION_SECONDS, r, DECISION_BUCKETS)
        self.predicted_hit_tokens: Counter = register(names.ROUTER_PREDICTED_HIT_TOKENS, r)
        self.predicted_hit_tokens_per_request: Histogram = register(
            names.ROUTER_PREDICTED_HIT_TOKENS_PER_REQUEST, r, HIT_TOKEN_BUCKETS)
        self.prompt_tokens: Counter = register(names.ROUTER_PROMPT_TOKENS, r)
        self.spills: Counter = register(names.ROUTER_SPILLS, r)
        self.retries: Counter = register(names.ROUTER_RETRIES, r)
        self.fallbacks: Counter = register(names.ROUTER_FALLBACKS, r)
        self.tokenizer_loaded: Gauge = register(names.ROUTER_TOKENIZER_LOADED, r)
        self.redis_errors: Counter = register(names.ROUTER_REDIS_ERRORS, r)
        self.redis_up: Gauge = register(names.ROUTER_REDIS_UP, r)
        self.replicas_healthy: Gauge = register(names.ROUTER_REPLICAS_HEALTHY, r)
        self.in_flight: Gauge = register(names.ROUTER_IN_FLIGHT, r)
        self.index_blocks: Gauge = register(names.ROUTER_INDEX_BLOCKS, r)
        self._index_block_ids: set[str] = set()
        self.held: Gauge = register(names.ROUTER_HELD_REQUESTS, r)
        self.holds: Counter = register(names.ROUTER_HOLDS, r)
        self.hold_seconds: Histogram = register(names.ROUTER_HOLD_SECONDS, r, HOLD_BUCKETS)
        self.cold_start_seconds: Histogram = register(names.ROUTER_COLD_START_SECONDS, r, HOLD_BUCKETS)
        self.activations: Counter = register(names.ROUTER_ACTIVATIONS, r)
        self.queued: Gauge = register(names.ROUTER_QUEUED_REQUESTS, r)
        self.queue_waits: Counter = register(names.ROUTER_QUEUE_WAITS, r)
        self.queue_wait_seconds: Histogram = register(names.ROUTER_QUEUE_WAIT_SECONDS, r, QUEUE_BUCKETS)
        self.tenant_requests: Counter = register(names.ROUTER_TENANT_REQUESTS, r)
        self.tenant_rate_limited: Counter = register(names.ROUTER_TENANT_RATE_LIMITED, r)
        self.tenant_limits_unchecked: Counter = register(names.ROUTER_TENANT_LIMITS_UNCHECKED, r)
        self.tenant_tokens: Counter = register(names.ROUTER_TENANT_TOKENS, r)
        self.tenant_queue_wait: Counter = register(names.ROUTER_TENANT_QUEUE_WAIT_SECONDS, r)
        self.fair_share_shared: Gauge = register(names.ROUTER_FAIR_SHARE_SHARED, r)
        for outcome in names.ROUTER_HOLD_OUTCOMES:
            self.holds.labels(outcome)
        for outcome in names.ROUTER_QUEUE_OUTCOMES:
            self.queue_waits.labels(outcome)
        for result in names.ROUTER_ACTIVATION_RESULTS:
            self.activations.labels(result)
        # Zero-valued series from the start: rate() needs two samples, and a dashboard panel or an
        # alert on a reason that has not happened yet should read 0, not "No data".
        for reason in names.ROUTER_RETRY_REASONS:
            self.retries.labels(reason)
        for reason in names.ROUTER_FALLBACK_REASONS:
            self.fallbacks.labels(reason)
        for status in ("502", "503"):
            self.requests.labels("none", policy, status)

    def set_index_blocks(self, sizes: dict[str, int]) -> None:
        """Blocks the index holds per replica; a replica the index forgot (dropped by discovery,
        or gone from Redis) leaves the gauge."""
        for replica_id, size in sizes.items():
            self.index_blocks.labels(replica_id).set(size)
        for replica_id in self._index_block_ids - sizes.keys():
            self.index_blocks.remove(replica_id)
        self._index_block_ids = set(sizes)


    def forget_replica(self, replica_id: str) -> None:
        """Drop every series labelled with a replica that left the fleet (a fleet scaled 1 -> 4 -> 1
        would otherwise keep plotting three dead replicas)."""
        for gauge in (self.in_flight, self.index_blocks):
            if replica_id in _label_values(gauge, ("replica",)):
                gauge.remove(replica_id)
        self._index_block_ids.discard(replica_id)
        for values in _label_values(self.requests, ("replica", "policy", "status"), replica=replica_id):
            self.requests.remove(*values)


def _label_values(
    metric: Counter | Gauge, names: tuple[str, ...], **match: str
) -> set[tuple[str, ...]] | set[str]:
    """The label values of ``metric``'s series (one name: the values themselves), those matching
    ``match`` only."""
    found: set = set()
    for family in metric.collect():
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in match.items()) and all(n in sample.labels for n in names):
                values = tuple(sample.labels[n] for n in names)
                found.add(values[0] if len(names) == 1 else values)
    return found


def is_spill(matched_blocks: dict[str, int], chosen: str, reason: str) -> bool:
    """The chosen replica holds fewer of the prompt's blocks than the best holder: the policy
    passed the cache over for load (the bound, or the score's load term), so the prefix is
    computed again. A sticky session's choice is the client's, not a spill."""
    best = max(matched_blocks.values(), default=0)
    return reason != "sticky" and best > 0 and matched_blocks.get(chosen, 0) < best
