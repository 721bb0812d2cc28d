"""Cache-aware scale-in: each scraped pod's pod-deletion-cost is its count of active KV blocks,
so a Deployment shrinking removes the replica with the fewest first and the warm caches stay."""

from __future__ import annotations

from typing import Any

from kvscale.operator.kube import Kube, path_for
from kvscale.operator.scaling import PodLoad

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"


def set_deletion_costs(kube: Kube, pods: list[dict[str, Any]], loads: list[PodLoad]) -> None:
    """Written only when it changes, and only for pods that reported."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    for load in loads:
        pod = by_name.get(load.pod)
        if pod is None or not load.has_metrics:
            continue
        cost = str(int(load.kv_blocks_active or 0))
        annotations = pod["metadata"].get("annotations") or {}
        if annotations.get(DELETION_COST_ANNOTATION) != cost:
            kube.merge_patch(path_for("v1", "pods", pod["metadata"]["namespace"], load.pod),
                             {"metadata": {"annotations": {DELETION_COST_ANNOTATION: cost}}})
