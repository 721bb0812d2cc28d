"""Converging an InferenceService's children: server-side apply of what its spec wants, the
generated Redis Secret created once, and deletion of the optional children it no longer wants.

A child's name that another object already holds (one a user made, or another controller's) is
never taken over: server-side apply by the operator's field manager would rewrite its owner and
fields, and two owners would fight over it every resync. It is left alone and reported. So is
a `NAME-redis` Secret the operator did not make (`ensure_redis_secret`).
"""

from __future__ import annotations

from typing import Any

import kopf

from kvscale.operator.children.labels import redis_name
from kvscale.operator.children.leader_worker_set import authkey_secret_name, build_authkey_secret
from kvscale.operator.children.owned import Images, build_children, unwanted_children
from kvscale.operator.children.redis import build_redis_secret
from kvscale.operator.config import FIELD_MANAGER
from kvscale.operator.inference_service import inference_service_path
from kvscale.operator.kube import Kube, object_path, path_for
from kvscale.operator.spec import InferenceServiceSpec

REDIS_SECRET_STATUS = "redisSecret"  # status field: the Redis Secret the operator made
# status field: the Secret of the key a replica's ranks share over several nodes, once made
AUTHKEY_SECRET_STATUS = "tensorParallelSecret"


def owned(child: dict[str, Any], owner: kopf.Body) -> dict[str, Any]:
    """`child` with the InferenceService as its controller: the garbage collector removes it."""
    kopf.adopt(child, owner=owner)
    return child


def held_by_another(existing: dict[str, Any] | None, uid: str) -> bool:
    """Whether ``existing`` (None: absent) is an object this InferenceService does not control."""
    if existing is None:
        return False
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    return not any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def describe_holder(child: dict[str, Any], existing: dict[str, Any]) -> str:
    refs = existing.get("metadata", {}).get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    holder = f"{controller['kind']} {controller['name']}" if controller else "no controller (made by hand?)"
    return f"{child['kind']} {child['metadata']['name']} already exists, held by {holder}"


def ensure_redis_secret(kube: Kube, owner: kopf.Body) -> str | None:
    """Create the Redis password Secret once; why an existing one is refused (None: it is ours).

    The operator may not read Secrets (docs/operator.md, "RBAC"), so it cannot ask who owns one
    that exists: it records the one it made in `status.redisSecret`, and a same-named Secret
    it did not record (made by a user, another controller, or planted with a known password) is
    refused. One made by an older operator is recognised by the Redis Deployment this
    InferenceService already controls."""
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    secret = redis_name(name)
    if ((owner.get("status") or {}).get(REDIS_SECRET_STATUS)) == secret:
        return None  # ours, made earlier: never made again (a reconcile keeps the live password)
    if kube.create_if_absent(path_for("v1", "secrets", namespace),
                             owned(build_redis_secret(name, namespace), owner)):
        record_redis_secret(kube, name, namespace, secret)
        return None
    redis = kube.get(path_for("apps/v1", "deployments", namespace, secret))
    if redis is not None and not held_by_another(redis, meta["uid"]):
        record_redis_secret(kube, name, namespace, secret)  # made by an operator before this record
        return None
    return (f"Secret {secret} already exists and was not made by the operator for this "
            "InferenceService (the internal Redis is not run with a password someone else chose)")


def record_redis_secret(kube: Kube, name: str, namespace: str, secret: str,
                        field: str = REDIS_SECRET_STATUS) -> None:
    kube.merge_patch(inference_service_path(namespace, name, "status"), {"status": {field: secret}})


def ensure_authkey_secret(kube: Kube, owner: kopf.Body) -> str | None:
    """Create the ranks' key Secret once (engine.nodes > 1); why an existing one is refused
    (None: it is ours). As for the Redis password: never read, recorded in the status when made,
    and a same-named Secret it did not record is refused (its key may be known to whoever made
    it)."""
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    secret = authkey_secret_name(name)
    if ((owner.get("status") or {}).get(AUTHKEY_SECRET_STATUS)) == secret:
        return None
    if kube.create_if_absent(path_for("v1", "secrets", namespace),
                             owned(build_authkey_secret(name, namespace), owner)):
        record_redis_secret(kube, name, namespace, secret, AUTHKEY_SECRET_STATUS)
        return None
    return (f"Secret {secret} already exists and was not made by the operator for this "
            "InferenceService (its ranks do not share a key someone else chose)")


def apply_children(kube: Kube, owner: kopf.Body, spec: InferenceServiceSpec, images: Images,
                   server_defaults: tuple[tuple[str, ...], ...] = (),
                   lws_served: bool = False) -> list[str]:
    """Apply every wanted child; the children left alone because another object holds their
    name, described (empty: everything applied). ``lws_served``: whether LeaderWorkerSets are
    (multi_node.py), for one left from engine.nodes > 1 to be deleted."""
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    conflicts = []
    children = build_children(name, namespace, spec, images, server_defaults)
    if spec.router.enabled and not spec.router.redis.external:
        refused = ensure_redis_secret(kube, owner)
        if refused:
            # No Redis under a password someone else chose (and may know).
            conflicts.append(refused)
            children = [c for c in children
                        if not (c["kind"] in ("Deployment", "Service")
                                and c["metadata"]["name"] == redis_name(name))]
    if spec.engine.nodes > 1:
        refused = ensure_authkey_secret(kube, owner)
        if refused:  # no ranks under a key someone else chose
            conflicts.append(refused)
            children = [c for c in children if c["kind"] != "LeaderWorkerSet"]
    for child in children:
        existing = kube.get(object_path(child))
        if held_by_another(existing, meta["uid"]):
            assert existing is not None
            conflicts.append(describe_holder(child, existing))
            continue
        kube.apply(object_path(child), owned(child, owner), FIELD_MANAGER)
    for api_version, plural, child_name in unwanted_children(name, namespace, spec, lws_served):
        existing = kube.get(path_for(api_version, plural, namespace, child_name))
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        # Only what this InferenceService owns: never a same-named object a user made.
        if any(ref.get("uid") == meta["uid"] for ref in owners):
            kube.delete(path_for(api_version, plural, namespace, child_name))
    return conflicts
