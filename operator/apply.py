"""Converging an InferenceService's children: server-side apply of what its spec wants, the
generated Redis Secret created once, and deletion of the optional children it no longer wants."""

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


def apply_children(kube: Kube, owner: kopf.Body, spec: InferenceServiceSpec, images: Images) -> None:
    meta = owner["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if spec.router.enabled and not spec.router.redis.external:
        # Created, never read (the operator may not read Secrets): 409 means it exists, and the
        # live password stays.
        kube.create_if_absent(path_for("v1", "secrets", namespace),
                              owned(build_redis_secret(name, namespace), owner))
    for child in build_children(name, namespace, spec, images):
        kube.apply(object_path(child), owned(child, owner), FIELD_MANAGER)
    for api_version, plural, child_name in unwanted_children(name, namespace, spec):
        existing = kube.get(path_for(api_version, plural, namespace, child_name))
        owners = (existing or {}).get("metadata", {}).get("ownerReferences") or []
        # Only what this InferenceService owns: never a same-named object a user made.
        if any(ref.get("uid") == meta["uid"] for ref in owners):
            kube.delete(path_for(api_version, plural, namespace, child_name))
