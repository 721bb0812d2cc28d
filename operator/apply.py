"""Converging an InferenceService's children: server-side apply of what its spec wants, the
generated Redis Secret created once, and deletion of the optional children it no longer wants.

A child's name that another object already holds (one a user made, or another controller's) is
never taken over: server-side apply by the operator's field manager would rewrite its owner and
fields, and two owners would fight over it every resync. It is left alone and reported.
"""

from __future__ import annotations

from typing import Any

import kopf

from kvscale.operator.children.owned import Images, build_children, unwanted_children
from kvscale.operator.children.redis import build_redis_secret
from kvscale.operator.config import FIELD_MANAGER
from kvscale.operator.kube import Kube, object_path, path_for
from kvscale.operator.spec import InferenceServiceSpec


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


def apply_children(kube: Kube, owner: kopf.Body, spec: InferenceServiceSpec, images: Images) -> list[str]:
    """Apply every wanted child; the children left alone because another object holds their
    name, described (empty: everything applied)."""
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if spec.router.enabled and not spec.router.redis.external:
        # Created, never read (the operator may not read Secrets): 409 means it exists, and the
        # live password stays.
        kube.create_if_absent(path_for("v1", "secrets", namespace),
                              owned(build_redis_secret(name, namespace), owner))
    conflicts = []
    for child in build_children(name, namespace, spec, images):
        existing = kube.get(object_path(child))
        if held_by_another(existing, meta["uid"]):
            assert existing is not None
            conflicts.append(describe_holder(child, existing))
            continue
        kube.apply(object_path(child), owned(child, owner), FIELD_MANAGER)
    for api_version, plural, child_name in unwanted_children(name, namespace, spec):
        existing = kube.get(path_for(api_version, plural, namespace, child_name))
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        # Only what this InferenceService owns: never a same-named object a user made.
        if any(ref.get("uid") == meta["uid"] for ref in owners):
            kube.delete(path_for(api_version, plural, namespace, child_name))
    return conflicts
