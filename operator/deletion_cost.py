"""Cache-aware scale-in: each scraped pod's pod-deletion-cost is what removing it would lose, so a
Deployment shrinking removes the coldest replica first and the warm caches stay.

What a removal loses (`pod_cost`): its live work (`kvscale:kv_blocks_active`, the blocks of
running requests: they must drain, and their prefixes are warm too, so they count twice) and its
reusable prefix cache (`kvscale:kv_blocks_cached`, free blocks still holding a prefix), but only
as much of that cache as the routers' index still points at when the routers say (`indexed`):
a prefix no router would send a request to is worth nothing to keep.

The annotation is written only on a meaningful change (`worth_patching`): with a cost moving by a
few blocks at every scrape under load, patching every pod every scrape was API-server traffic for
no change in which pod goes first.
"""

from __future__ import annotations

import math
from typing import Any

from kvscale.operator.kube import Kube, path_for
from kvscale.operator.scaling import PodLoad

DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
LIVE_WEIGHT = 2  # a live block: a running request to drain, and a warm prefix
# A cost is rewritten once it moved by this many blocks and this share of its value.
MIN_CHANGE_BLOCKS = 16
MIN_CHANGE_SHARE = 0.2


def pod_cost(active_blocks: float, cached_blocks: float, indexed_blocks: float | None = None) -> int:
    """What removing the pod would lose, in KV blocks."""
    warm = max(0.0, cached_blocks)
    if indexed_blocks is not None:
        # The index holds the pod's active and cached blocks alike; what is left past the active
        # ones is the cache the routers still send requests to.
        warm = min(warm, max(0.0, indexed_blocks - active_blocks))
    return int(LIVE_WEIGHT * max(0.0, active_blocks) + math.floor(warm))


def worth_patching(old: str | None, new: int) -> bool:
    """A missing or unreadable annotation, or a change both large and relatively large."""
    try:
        previous = int(old) if old is not None else None
    except ValueError:
        previous = None
    if previous is None:
        return True
    change = abs(new - previous)
    return change >= MIN_CHANGE_BLOCKS and change >= MIN_CHANGE_SHARE * max(previous, new)


def costs_to_write(pods: list[dict[str, Any]], loads: list[PodLoad],
                   indexed: dict[str, float] | None = None) -> dict[str, int]:
    """Pod name -> the cost to write, for the pods that reported and whose cost changed
    meaningfully (pure). ``indexed``: blocks the routers' index holds per pod name."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    out: dict[str, int] = {}
    for load in loads:
        pod = by_name.get(load.pod)
        if pod is None or not load.has_metrics:
            continue
        cost = pod_cost(load.kv_blocks_active or 0.0, load.kv_blocks_cached or 0.0,
                        (indexed or {}).get(load.pod))
        annotations = pod["metadata"].get("annotations") or {}
        if worth_patching(annotations.get(DELETION_COST_ANNOTATION), cost):
            out[load.pod] = cost
    return out


def set_deletion_costs(kube: Kube, pods: list[dict[str, Any]], loads: list[PodLoad],
                       indexed: dict[str, float] | None = None) -> int:
    """Patch what `costs_to_write` says; returns the pods patched."""
    namespaces = {p["metadata"]["name"]: p["metadata"]["namespace"] for p in pods}
    writes = costs_to_write(pods, loads, indexed)
    for name, cost in writes.items():
        kube.merge_patch(path_for("v1", "pods", namespaces[name], name),
                         {"metadata": {"annotations": {DELETION_COST_ANNOTATION: str(cost)}}})
    return len(writes)
