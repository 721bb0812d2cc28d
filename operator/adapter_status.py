"""`status.adapters`: each of an InferenceService's `spec.adapters` and how many of its servers have
it loaded, as the routers' /health reports their replicas' adapters (docs/operator.md, "LoRA
adapters"). A pure function of the spec and the router reports; bounded as `spec.adapters` is
(at most 64 entries, CRD maxItems)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvscale.operator.router_reports import RouterReport
from kvscale.operator.spec import LoraAdapter

MAX_ADAPTERS = 64  # the CRD's maxItems of spec.adapters and status.adapters


def adapter_status(adapters: Sequence[LoraAdapter], reports: list[RouterReport] | None) -> list[dict[str, Any]] | None:
    """One entry per spec adapter, in the spec's order: ``loadedReplicas`` of the ``replicas`` the
    answering routers report on, ``loaded`` when every one of them (at least one) has it. The
    routers may lag each other by a heartbeat: a replica counts as having it when any router says
    so. None without adapters (the field goes) or without a router (nothing reports)."""
    if not adapters or reports is None:
        return None
    by_replica: dict[str, set[str]] = {}
    for report in reports:
        if report.error:
            continue
        for replica, names in report.adapters.items():
            by_replica.setdefault(replica, set()).update(names)
    total = len(by_replica)
    out = []
    for adapter in adapters[:MAX_ADAPTERS]:
        loaded = sum(1 for names in by_replica.values() if adapter.name in names)
        out.append({"name": adapter.name, "uri": adapter.uri, "loadedReplicas": loaded,
                    "replicas": total, "loaded": total > 0 and loaded == total})
    return out
