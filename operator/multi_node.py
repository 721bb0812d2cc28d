"""Whether this cluster can run a replica over several nodes (spec.engine.nodes > 1, docs/operator.md
"A replica over several nodes"): the LeaderWorkerSet kind (sigs.k8s.io/lws) must be served.

Without it such a spec gets nothing applied and `Synced` False, reason LeaderWorkerSetUnavailable,
saying to install LWS: its servers would have no way to start their ranks together. The operator
watches no CRDs (docs/operator.md, "Running the operator"): API discovery, open to every
authenticated client, tells whether the kind is served, asked again once the answer is older than
a few seconds (a CRD installed later is seen at the next resync after that).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvscale.operator.apply import AUTHKEY_SECRET_STATUS
from kvscale.operator.children.leader_worker_set import API_VERSION, CRD, PLURAL
from kvscale.operator.conditions import SYNCED, Condition
from kvscale.operator.kube import Kube
from kvscale.operator.spec import InferenceServiceSpec

LEADER_WORKER_SET_UNAVAILABLE = "LeaderWorkerSetUnavailable"
# How long one discovery answer stands: short, since a resync after installing LWS should see it,
# long enough that a resync of many InferenceServices asks once.
DISCOVERY_TTL_S = 10.0


def kind_served(kube: Kube) -> bool:
    """Whether the API server serves LeaderWorkerSets of version v1 (LWS's CRD installed)."""
    group = kube.get(f"/apis/{API_VERSION}")
    return any(r.get("name") == PLURAL for r in (group or {}).get("resources") or [])


def still_fresh(asked_at: float | None, now: float, ttl_s: float) -> bool:
    """Whether an answer got at ``asked_at`` (None: never asked) still stands at ``now``."""
    return asked_at is not None and 0.0 <= now - asked_at < ttl_s


@dataclass
class LeaderWorkerSetDiscovery:
    """`kind_served`, remembered for ``ttl_s``."""

    ttl_s: float = DISCOVERY_TTL_S
    _answer: tuple[float, bool] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def served(self, kube: Kube, now: float | None = None) -> bool:
        moment = time.monotonic() if now is None else now
        with self._lock:
            if self._answer is not None and still_fresh(self._answer[0], moment, self.ttl_s):
                return self._answer[1]
        answer = kind_served(kube)
        with self._lock:
            self._answer = (moment, answer)
        return answer


def asks_discovery(spec: InferenceServiceSpec, status: dict[str, Any]) -> bool:
    """Whether reconciling needs to know if LeaderWorkerSets are served: to make one, or to
    delete the one an earlier spec over several nodes made (its key Secret, recorded in the
    status, says there was one). The other InferenceServices cost no discovery call (pure)."""
    return spec.engine.nodes > 1 or bool(status.get(AUTHKEY_SECRET_STATUS))


def served_for(discovery: LeaderWorkerSetDiscovery, kube: Kube, spec: InferenceServiceSpec,
               status: dict[str, Any]) -> bool:
    """``discovery``'s answer where ``asks_discovery``, else False (nothing to make or delete)."""
    return asks_discovery(spec, status) and discovery.served(kube)


def refusal(spec: InferenceServiceSpec, served: bool) -> Condition | None:
    """Synced=False for a replica over several nodes where LeaderWorkerSets are not served;
    None when the spec needs none or the kind is there (pure)."""
    if spec.engine.nodes <= 1 or served:
        return None
    return Condition(SYNCED, False, LEADER_WORKER_SET_UNAVAILABLE,
                     f"engine.nodes is {spec.engine.nodes}: a replica over several nodes runs as a "
                     f"LeaderWorkerSet, and CustomResourceDefinition {CRD} ({API_VERSION}) is not "
                     "served here: install LeaderWorkerSet (https://lws.sigs.k8s.io, v0.7 or later) "
                     "or set engine.nodes to 1; nothing is applied")


def as_rollout(leader_worker_set: dict[str, Any] | None) -> dict[str, Any] | None:
    """A LeaderWorkerSet as pod_status.assess reads a Deployment (pure): its status counts groups,
    i.e. replicas, as a Deployment's counts pods; it records no observedGeneration, so its counts
    are taken as the current generation's."""
    if leader_worker_set is None:
        return None
    status = dict(leader_worker_set.get("status") or {})
    status["observedGeneration"] = leader_worker_set.get("metadata", {}).get("generation", 0)
    return {**leader_worker_set, "status": status}
