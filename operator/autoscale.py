"""One autoscaler run for one InferenceService: scrape its ready pods, keep their deletion costs
and status.kvUsage, and, when autoscaling is on, decide (operator/scaling.py) and scale through
the scale subresource, as `kubectl scale` does.

With minReplicas 0 the routers' /health also says what they hold and how long they have been
idle (the `Demand`), and the run records each scale from zero: status.activationStarted when
requests are first seen held with no ready replica, then status.lastColdStartSeconds and an
`Activated` Event when the first replica is ready."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from kvscale.operator import conditions, hpa, scaling, scraping
from kvscale.operator.adapter_status import adapter_status
from kvscale.operator.apply import apply_children
from kvscale.operator.children.labels import as_selector_string, router_selector, selector_string
from kvscale.operator.conditions import SCALING_ACTIVE, Condition
from kvscale.operator.deletion_cost import set_deletion_costs
from kvscale.operator.inference_service import (
    ObjectKey,
    as_body,
    being_deleted,
    inference_service_path,
    typed_spec,
)
from kvscale.operator.kube import ApiError, path_for
from kvscale.operator.metrics import ReplicaCounts
from kvscale.operator.multi_node import refusal as multi_node_refusal
from kvscale.operator.multi_node import served_for
from kvscale.operator.router_reports import (
    RouterReport,
    demand_from_reports,
    indexed_blocks,
    prefix_routing_condition,
    read_router_reports,
)
from kvscale.operator.runtime import Runtime
from kvscale.operator.spec import InferenceServiceSpec, parse_spec
from kvscale.operator.status import AUTOSCALING_DISABLED, refresh_status

log = logging.getLogger("kvscale.operator")


def load_status(estimate: scaling.LoadEstimate | None) -> dict[str, Any]:
    if estimate is None:
        return {}
    return {"kvUsage": round(estimate.kv_usage, 4), "waitingRequests": int(round(estimate.waiting))}


def router_reports(runtime: Runtime, name: str, namespace: str,
                   spec: InferenceServiceSpec) -> list[RouterReport] | None:
    """What the ready router pods say; None without a router."""
    if not spec.router.enabled:
        return None
    pods = runtime.kube.list(path_for("v1", "pods", namespace), as_selector_string(router_selector(name)))
    return read_router_reports(pods, runtime.config.scrape_timeout,
                               runtime.config.allow_metrics_url_override,
                               runtime.config.scrape_max_bytes)


def competing_hpas(runtime: Runtime, name: str, namespace: str) -> list[str]:
    """HPAs targeting this InferenceService (none if the operator may not list them: an RBAC
    older than this check must not stop autoscaling)."""
    try:
        items = runtime.kube.list(path_for("autoscaling/v2", "horizontalpodautoscalers", namespace))
    except ApiError as exc:
        if exc.status in (403, 404):
            log.debug("%s/%s: HPAs not listed (%s)", namespace, name, exc)
            return []
        raise
    return hpa.targeting(items, name)


def router_conditions(reports: list[RouterReport] | None) -> list[Condition]:
    """PrefixRouting, from what the router pods say of their tokenizers; none without a router."""
    return [] if reports is None else [prefix_routing_condition(reports)]


def activation_status(old_status: dict[str, Any], ready: int, held: int, now_text: str,
                      cold_starts: list[float], ended: Sequence[tuple[float, float]] = (),
                      ) -> tuple[dict[str, Any], str | None]:
    """The status fields of a scale from zero, and the Event message when one just ended (pure).

    It starts when requests are held while no replica is ready; it ends at the first ready
    replica. The cold start is the routers' own measure (first held request to a replica able
    to take it) when one reports it, else the time since the start was recorded. A router raises
    the scale itself (router/wake.py), so a replica can be ready before any scrape saw requests
    held: ``ended`` holds the routers' cold starts with how long ago each ended, and one that ended
    after status.lastColdStartTime (by more than the routers' spread) is recorded as it is."""
    started = old_status.get("activationStarted")
    fields: dict[str, Any] = {"heldRequests": held}
    if ready == 0:
        if held > 0 and not started:
            fields["activationStarted"] = now_text
        return fields, None
    now = conditions.parse_rfc3339(now_text)
    if started:
        measured = max(cold_starts) if cold_starts else (now - conditions.parse_rfc3339(started)).total_seconds()
        fields["activationStarted"] = None
    else:
        recorded = old_status.get("lastColdStartTime")
        since = (now - conditions.parse_rfc3339(recorded)).total_seconds() if recorded else None
        unseen = [seconds for seconds, ago in ended if since is None or ago < since - MISSED_COLD_START_SPREAD_S]
        if not unseen:
            return fields, None
        measured = max(unseen)
    fields["lastColdStartSeconds"] = round(measured, 1)
    fields["lastColdStartTime"] = now_text
    return fields, f"first replica ready {measured:.1f} s after requests were held at zero replicas"


# Routers see the same replica ready up to a few of their syncs apart: a cold start reported as
# ending within this of the one recorded is that one.
MISSED_COLD_START_SPREAD_S = 10.0


def scaled_message(previous: int, decision: scaling.ScaleDecision) -> str:
    """The Scaled Event's message: the change, and the decision's why (scaling.describe)."""
    direction = "up" if decision.replicas > previous else "down"
    return (f"scaled {direction} from {previous} to {decision.replicas} replicas "
            f"({decision.reason}): {decision.message}")


def scaling_condition(decision: scaling.ScaleDecision) -> Condition:
    """ScalingActive from a decision; its message is the decision's why, which `kubectl describe
    kvis` shows between Scaled Events (those come only with a change)."""
    # At zero (or going there) the routers' demand is the metric: scaling is active.
    active = decision.estimate is not None or decision.reason in scaling.ZERO_REASONS
    return Condition(SCALING_ACTIVE, active, decision.reason if active else "NoMetrics",
                     decision.message)


@dataclass(frozen=True)
class Observation:
    pods: list[dict[str, Any]]
    loads: list[scaling.PodLoad]
    reports: list[RouterReport] | None


def observe(runtime: Runtime, key: ObjectKey) -> Observation | None:
    """The pods and what they and the routers say (None: the object is gone). Read without the
    InferenceService's lock: a scrape may take its whole deadline, and reconcile must not wait
    for it (docs/operator.md, "Scraping")."""
    kube, config = runtime.kube, runtime.config
    current = kube.get(inference_service_path(key.namespace, key.name))
    if current is None or current["metadata"]["uid"] != key.uid or being_deleted(current):
        return None
    pods = kube.list(path_for("v1", "pods", key.namespace), selector_string(key.name))
    loads = scraping.scrape_pods(pods, config.scrape_timeout, config.allow_metrics_url_override,
                                 config.scrape_max_bytes)
    reports = router_reports(runtime, key.name, key.namespace, typed_spec(current))
    return Observation(pods, loads, reports)


def autoscale(runtime: Runtime, key: ObjectKey, logger: kopf.Logger) -> None:
    seen = observe(runtime, key)
    if seen is None:
        return
    kube, config = runtime.kube, runtime.config
    pods, loads, reports = seen.pods, seen.loads, seen.reports
    with runtime.lock(key.uid):
        # Read again under the lock: a reconcile may have run while the pods were scraped.
        current = kube.get(inference_service_path(key.namespace, key.name))
        if current is None or current["metadata"]["uid"] != key.uid or being_deleted(current):
            return
        spec = typed_spec(current)
        name, namespace = key.name, key.namespace
        set_deletion_costs(kube, pods, loads, indexed_blocks(reports) if reports else None)
        policy = spec.autoscaling
        demand = demand_from_reports(reports or [])
        estimate = scaling.estimate_load(loads, policy, demand.queued)
        extra = load_status(estimate)
        extra["adapters"] = adapter_status(spec.adapters, reports)
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready = sum(1 for p in live if scraping.is_ready(p))
        if policy.scales_to_zero:
            fields, activated = activation_status(
                current.get("status") or {}, ready, demand.held, conditions.now_rfc3339(),
                [r.last_cold_start_s for r in reports or [] if r.last_cold_start_s is not None],
                [(r.last_cold_start_s, r.last_cold_start_ago_s) for r in reports or []
                 if r.last_cold_start_s is not None and r.last_cold_start_ago_s is not None])
            extra.update(fields)
            runtime.metrics.observe_activation(key.uid, namespace, name, demand.held,
                                               fields.get("lastColdStartSeconds"))
            if activated is not None:
                log.info("%s/%s: %s", namespace, name, activated)
                kopf.event(as_body(current), type="Normal", reason="Activated", message=activated)
        if not policy.enabled:
            runtime.autoscalers.pop(key.uid, None)
            runtime.metrics.observe(key.uid, namespace, name, policy,
                                    ReplicaCounts(spec.replicas, len(live), ready),
                                    estimate, None, spec.replicas)
            refresh_status(runtime, name, namespace, extra,
                           [AUTOSCALING_DISABLED, *router_conditions(reports)])
            return

        competing = competing_hpas(runtime, name, namespace)
        if competing:
            # Forget the history: once the HPA goes, a full scale-down window is watched again.
            runtime.autoscalers.pop(key.uid, None)
            refresh_status(runtime, name, namespace, extra,
                           [hpa.external_autoscaler_condition(competing), *router_conditions(reports)])
            return

        state = runtime.autoscalers.get(key.uid, scaling.AutoscalerState())
        decision, runtime.autoscalers[key.uid] = scaling.decide(
            time.monotonic(), loads, spec.replicas, policy, state, demand)
        extra["desiredReplicas"] = decision.replicas
        previous = spec.replicas
        runtime.metrics.observe(key.uid, namespace, name, policy,
                                ReplicaCounts(decision.replicas, len(live), ready),
                                estimate, decision, previous)
        if decision.replicas != previous:
            kube.merge_patch(inference_service_path(namespace, name, "scale"),
                             {"spec": {"replicas": decision.replicas}})
            # The children at once, not a resync later (never a spec reconcile refuses).
            lws_served = served_for(runtime.lws, kube, spec, current.get("status") or {})
            if config.refusal(spec) is None and multi_node_refusal(spec, lws_served) is None:
                apply_children(kube, as_body(current),
                               parse_spec({**current["spec"], "replicas": decision.replicas}),
                               config.images, config.server_defaults, lws_served)
            extra["lastScaleTime"] = conditions.now_rfc3339()
            message = scaled_message(previous, decision)
            log.info("%s/%s: %s", namespace, name, message)
            kopf.event(as_body(current), type="Normal", reason="Scaled", message=message)
        refresh_status(runtime, name, namespace, extra,
                       [scaling_condition(decision), *router_conditions(reports)])
