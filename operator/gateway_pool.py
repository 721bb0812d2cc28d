"""An InferenceService's InferencePool, applied once the Gateway API Inference Extension's CRD
is served, and the `InferencePoolReady` condition saying where it stands (docs/gateway.md,
"From an InferenceService").

The pool is apart from the other children (operator/apply.py) because its kind is optional: a
cluster without GIE's CRD still serves the InferenceService (routers, servers, the picker port),
and the condition says what is missing; the resync that follows the CRD's installation creates
the pool. The operator watches no CRDs (docs/operator.md, "Running the operator"): API discovery,
open to every authenticated client, tells whether the kind is served.
"""

from __future__ import annotations

import kopf

from kvscale.operator.apply import describe_holder, held_by_another, owned
from kvscale.operator.children.inference_pool import (
    POOL_API_VERSION,
    POOL_CRD,
    POOL_PLURAL,
    build_inference_pool,
    picker_service_name,
    pool_wanted,
)
from kvscale.operator.conditions import INFERENCE_POOL_READY, Condition, find_condition
from kvscale.operator.config import FIELD_MANAGER
from kvscale.operator.kube import ApiError, Kube, object_path, path_for
from kvscale.operator.spec import SERVER_PORT, InferenceServiceSpec

CRD_NOT_INSTALLED = "CRDNotInstalled"


def pool_kind_served(kube: Kube) -> bool:
    """Whether the API server serves InferencePools of version v1 (GIE's CRD installed)."""
    group = kube.get(f"/apis/{POOL_API_VERSION}")
    return any(r.get("name") == POOL_PLURAL for r in (group or {}).get("resources") or [])


def sync_inference_pool(kube: Kube, owner: kopf.Body, spec: InferenceServiceSpec) -> Condition | None:
    """Apply the pool ``spec`` wants, or delete the one this InferenceService owns that it no
    longer wants; the condition to report (None: no pool wanted, no condition)."""
    meta = owner["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    if not pool_wanted(spec):
        # Only where a pool was wanted before (its condition is there): no API call for the
        # InferenceServices that never asked for one, at every resync.
        if find_condition((owner.get("status") or {}).get("conditions"), INFERENCE_POOL_READY):
            delete_owned_pool(kube, name, namespace, uid)
        return None
    try:
        if not pool_kind_served(kube):
            return Condition(INFERENCE_POOL_READY, False, CRD_NOT_INSTALLED,
                             f"CustomResourceDefinition {POOL_CRD} ({POOL_API_VERSION}, the Gateway API "
                             "Inference Extension's) is not installed: the routers serve the endpoint "
                             "picker, and the InferencePool is created once the CRD is installed")
        pool = build_inference_pool(name, namespace, spec)
        existing = kube.get(object_path(pool))
        if held_by_another(existing, uid):
            assert existing is not None
            return Condition(INFERENCE_POOL_READY, False, "NameConflict",
                             describe_holder(pool, existing) + ": left untouched")
        kube.apply(object_path(pool), owned(pool, owner), FIELD_MANAGER)
    except ApiError as exc:
        # The servers and routers serve without a pool: report, and let the resync try again.
        return Condition(INFERENCE_POOL_READY, False, "Forbidden" if exc.status == 403 else "ApplyFailed",
                         f"InferencePool {name}: {exc}")
    return Condition(INFERENCE_POOL_READY, True, "Applied",
                     f"InferencePool {name} selects the servers on port {SERVER_PORT}; its endpoint "
                     f"picker is Service {picker_service_name(name)} port "
                     f"{spec.router.inference_pool.ext_proc_port}")


def delete_owned_pool(kube: Kube, name: str, namespace: str, uid: str) -> None:
    """The pool this InferenceService owns, deleted; never a same-named one it does not own."""
    path = path_for(POOL_API_VERSION, POOL_PLURAL, namespace, name)
    try:
        if not pool_kind_served(kube):
            return
        existing = kube.get(path)
        refs = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        if any(ref.get("uid") == uid for ref in refs):
            kube.delete(path)
    except ApiError as exc:
        if exc.status != 403:  # not granted (the chart's inferencePool.enabled false): nothing made
            raise
