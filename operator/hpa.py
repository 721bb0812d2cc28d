"""An InferenceService scaled by the real HorizontalPodAutoscaler instead of the operator.

The HPA (kube-controller-manager's controller) targets the InferenceService's scale subresource
(`spec.replicas`, `status.selector`) and reads the servers' concurrency, in-flight requests per
pod as KubeAI scales on, from the custom metrics API (`custom.metrics.k8s.io`) that
prometheus-adapter serves from Prometheus. This module builds the two pieces a user writes for
that: prometheus-adapter's rules and the HPA. The InferenceService keeps `autoscaling.enabled:
false`, so the operator honours whatever replicas the HPA writes and never fights it
(docs/operator.md, "An external autoscaler").

Series names come from kvscale.metric_names (vLLM's names); the labels are those the chart's
PodMonitor puts on every server series (namespace, pod, inferenceservice).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from kvscale import metric_names as names
from kvscale.operator.conditions import SCALING_ACTIVE, Condition
from kvscale.operator.spec import GROUP, PLURAL, VERSION

# The custom metric's name in custom.metrics.k8s.io (no ':' there: it is a URL path segment).
CONCURRENCY_METRIC = "kvscale_concurrency"
# The label the chart's PodMonitor copies the pod's InferenceService name into.
INFERENCE_SERVICE_LABEL = "inferenceservice"
KIND = "InferenceService"
EXTERNAL_AUTOSCALER = "ExternalAutoscaler"


def concurrency_series() -> tuple[str, str]:
    """A replica's concurrency: requests in its running batch plus those waiting for it."""
    return names.NUM_REQUESTS_RUNNING.series, names.NUM_REQUESTS_WAITING.series


def adapter_rules() -> dict[str, Any]:
    """prometheus-adapter's `--config`: `kvscale_concurrency` per pod (for an HPA's Pods metric)
    and per InferenceService (an Object metric: the sum over its pods)."""
    running, waiting = concurrency_series()
    return {"rules": [{
        # Discovery: every pod series of the running gauge names one pod (and its service).
        "seriesQuery": f'{{__name__="{running}",namespace!="",pod!=""}}',
        "resources": {"overrides": {
            "namespace": {"resource": "namespaces"},
            "pod": {"resource": "pods"},
            INFERENCE_SERVICE_LABEL: {"group": GROUP, "resource": PLURAL},
        }},
        "name": {"matches": f"^{running}$", "as": CONCURRENCY_METRIC},
        # Both gauges of the selected pods, summed by pod or by InferenceService.
        "metricsQuery": (f'sum by (<<.GroupBy>>) ({{__name__=~"{running}|{waiting}",'
                         '<<.LabelMatchers>>})'),
    }]}


def quantity(value: float) -> str:
    """A Kubernetes quantity for ``value``: whole numbers as is, else in thousandths ("1500m")."""
    milli = Decimal(str(value)) * 1000
    if milli != milli.to_integral_value() or value < 0:
        raise ValueError(f"{value} is not a non-negative multiple of 0.001")
    return str(int(milli) // 1000) if int(milli) % 1000 == 0 else f"{int(milli)}m"


def horizontal_pod_autoscaler(
    name: str,
    namespace: str,
    *,
    min_replicas: int,
    max_replicas: int,
    target_concurrency: float,
    scale_down_stabilization_s: int = 300,
) -> dict[str, Any]:
    """An `autoscaling/v2` HPA on InferenceService ``name``: average concurrency per server pod
    at ``target_concurrency``. ``scale_down_stabilization_s`` is the HPA's own default (300 s)
    unless given; HPA cannot scale to zero (its minReplicas is at least 1 without an alpha gate)."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"need 1 <= minReplicas ({min_replicas}) <= maxReplicas ({max_replicas})")
    if target_concurrency <= 0:
        raise ValueError(f"target concurrency must be positive, not {target_concurrency}")
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name},
            "minReplicas": min_replicas,
            "maxReplicas": max_replicas,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": CONCURRENCY_METRIC},
                "target": {"type": "AverageValue", "averageValue": quantity(target_concurrency)},
            }}],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": scale_down_stabilization_s}},
        },
    }


def targeting(hpas: list[dict[str, Any]], name: str) -> list[str]:
    """The names of the HPAs (of one namespace) whose scaleTargetRef is InferenceService ``name``
    (any version of the group: the HPA resolves it through the scale subresource)."""
    found = []
    for item in hpas:
        ref = (item.get("spec") or {}).get("scaleTargetRef") or {}
        group = str(ref.get("apiVersion", "")).split("/", 1)[0]
        if ref.get("kind") == KIND and ref.get("name") == name and group == GROUP:
            found.append(item["metadata"]["name"])
    return sorted(found)


def external_autoscaler_condition(hpa_names: list[str]) -> Condition:
    """ScalingActive while the built-in autoscaler steps aside for an HPA: two writers of
    spec.replicas would undo each other's decisions at every sync."""
    listed = ", ".join(hpa_names)
    noun = "HorizontalPodAutoscaler" if len(hpa_names) == 1 else "HorizontalPodAutoscalers"
    return Condition(
        SCALING_ACTIVE, False, EXTERNAL_AUTOSCALER,
        f"{noun} {listed} also scale(s) this InferenceService while spec.autoscaling.enabled is "
        "true; the operator's autoscaler stands aside: set spec.autoscaling.enabled to false to "
        f"leave spec.replicas to the HPA, or delete the HPA to use the operator's")
