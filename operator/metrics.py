"""The operator's own Prometheus metrics, per InferenceService: what the autoscaler saw, what it
aimed for and what it did (names from kvscale/metric_names.py).

Served by `kvscale operator --metrics-port` from a registry of its own. Series are labelled with
the InferenceService's `namespace` and `inferenceservice`; scrape the operator with
`honor_labels` so that they are not renamed to `exported_namespace`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest

from kvscale import metric_names as names
from kvscale.metric_registry import register
from kvscale.operator.scaling import LoadEstimate, ScaleDecision
from kvscale.operator.spec import AutoscalingPolicy

# Every (direction, reason) a change of replicas can have (scaling.decide's reasons), created at
# zero when a service is first seen: a counter born at 1 is invisible to increase().
_USUAL_DECISIONS = (("up", "ScaleUp"), ("up", "Panic"), ("up", "Bounds"),
                    ("down", "ScaleDown"), ("down", "Bounds"), ("up", "Activate"),
                    ("down", "ScaleToZero"))


@dataclass(frozen=True)
class ReplicaCounts:
    desired: int
    current: int  # pods not terminating
    ready: int


def scale_direction(previous: int, replicas: int) -> str | None:
    if replicas > previous:
        return "up"
    if replicas < previous:
        return "down"
    return None


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        self.load = register(names.OPERATOR_LOAD, r)
        self.kv_usage = register(names.OPERATOR_KV_USAGE, r)
        self.occupancy = register(names.OPERATOR_OCCUPANCY, r)
        self.waiting = register(names.OPERATOR_WAITING, r)
        self.prefill_seconds = register(names.OPERATOR_PREFILL_SECONDS, r)
        self.target_kv_usage = register(names.OPERATOR_TARGET_KV_USAGE, r)
        self.target_queue = register(names.OPERATOR_TARGET_QUEUE, r)
        self.target_prefill = register(names.OPERATOR_TARGET_PREFILL_SECONDS, r)
        self.panic = register(names.OPERATOR_PANIC, r)
        self.desired = register(names.OPERATOR_DESIRED, r)
        self.current = register(names.OPERATOR_CURRENT, r)
        self.ready = register(names.OPERATOR_READY, r)
        self.min_replicas = register(names.OPERATOR_MIN, r)
        self.max_replicas = register(names.OPERATOR_MAX, r)
        self.scale_decisions = register(names.OPERATOR_SCALE_DECISIONS, r)
        self.reconcile_errors = register(names.OPERATOR_RECONCILE_ERRORS, r)
        self.held = register(names.OPERATOR_HELD_REQUESTS, r)
        self.cold_start = register(names.OPERATOR_COLD_START_SECONDS, r)
        self._per_service = (self.load, self.kv_usage, self.occupancy, self.waiting,
                             self.prefill_seconds, self.target_kv_usage, self.target_queue,
                             self.target_prefill, self.panic, self.desired, self.current,
                             self.ready, self.min_replicas, self.max_replicas, self.held,
                             self.cold_start)
        self._known: dict[str, tuple[str, str]] = {}  # uid -> (namespace, name)
        self._lock = threading.Lock()

    def register(self, uid: str, namespace: str, name: str) -> None:
        """Create a service's counters at zero; the reconciler calls it long before the first
        decision, so that a scrape holds the zero before the first increment."""
        with self._lock:
            if uid in self._known:
                return
            self._known[uid] = (namespace, name)
        for direction, reason in _USUAL_DECISIONS:
            self.scale_decisions.labels(namespace, name, direction, reason)
        for handler in ("reconcile", "autoscale"):
            self.reconcile_errors.labels(namespace, name, handler)

    def observe(self, uid: str, namespace: str, name: str, policy: AutoscalingPolicy,
                counts: ReplicaCounts, estimate: LoadEstimate | None,
                decision: ScaleDecision | None, previous: int) -> None:
        """One autoscaler run: the signal, the target, the replicas and the decision taken."""
        self.register(uid, namespace, name)
        key = (namespace, name)
        self.target_kv_usage.labels(*key).set(policy.target_kv_usage)
        self.target_queue.labels(*key).set(policy.target_queue_length)
        self.target_prefill.labels(*key).set(policy.target_prefill_seconds)
        if policy.enabled:
            self.min_replicas.labels(*key).set(policy.min_replicas)
            self.max_replicas.labels(*key).set(policy.max_replicas)
        else:
            # Bounds no autoscaler applies: a service scaled by hand to 4 is not "at its max".
            for gauge in (self.min_replicas, self.max_replicas):
                try:
                    gauge.remove(*key)
                except KeyError:
                    pass
        self.desired.labels(*key).set(counts.desired)
        self.current.labels(*key).set(counts.current)
        self.ready.labels(*key).set(counts.ready)
        if estimate is not None:
            self.load.labels(*key).set(estimate.load)
            self.kv_usage.labels(*key).set(estimate.kv_usage)
            self.occupancy.labels(*key).set(estimate.occupancy)
            self.waiting.labels(*key).set(estimate.waiting)
            # Shown on its own: the decision message names it, a dashboard needs it over time.
            self.prefill_seconds.labels(*key).set(estimate.prefill_seconds)
        self.panic.labels(*key).set(1 if decision is not None and decision.panic else 0)
        if decision is not None:
            direction = scale_direction(previous, decision.replicas)
            if direction is not None:
                self.scale_decisions.labels(*key, direction, decision.reason).inc()

    def observe_activation(self, uid: str, namespace: str, name: str, held: int,
                           cold_start_s: float | None) -> None:
        """A service that scales to zero: the requests its routers hold, the last cold start."""
        self.register(uid, namespace, name)
        self.held.labels(namespace, name).set(held)
        if cold_start_s is not None:
            self.cold_start.labels(namespace, name).set(cold_start_s)

    def error(self, uid: str, namespace: str, name: str, handler: str) -> None:
        self.register(uid, namespace, name)
        self.reconcile_errors.labels(namespace, name, handler).inc()

    def forget(self, uid: str) -> None:
        """Drop a deleted service's series, so dashboards stop showing it."""
        with self._lock:
            key = self._known.pop(uid, None)
        if key is None:
            return
        for gauge in self._per_service:
            try:
                gauge.remove(*key)
            except KeyError:
                pass
        for labels in list(self.scale_decisions._metrics):  # no public way to list children
            if labels[:2] == key:
                self.scale_decisions.remove(*labels)
        for labels in list(self.reconcile_errors._metrics):
            if labels[:2] == key:
                self.reconcile_errors.remove(*labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
