"""The InferenceService as the API serves it: its key, its API paths, its typed spec, whether it
is being deleted, and a raw object as the `kopf.Body` kopf's helpers take."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import kopf

from kvscale.operator.kube import path_for
from kvscale.operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec, parse_spec

API_VERSION = f"{GROUP}/{VERSION}"


@dataclass(frozen=True)
class ObjectKey:
    """Enough to read an InferenceService afresh; `uid` tells a replacement of the same name."""

    uid: str
    namespace: str
    name: str

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> ObjectKey:
        meta = obj["metadata"]
        return cls(uid=meta["uid"], namespace=meta["namespace"], name=meta["name"])


def inference_service_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path_for(API_VERSION, PLURAL, namespace, name, subresource)


def typed_spec(obj: Mapping[str, Any]) -> InferenceServiceSpec:
    """The spec, or a kopf.PermanentError a retry cannot fix."""
    try:
        return parse_spec(dict(obj.get("spec") or {}))
    except (ValueError, KeyError, TypeError) as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc


def being_deleted(obj: Mapping[str, Any]) -> bool:
    return bool(obj["metadata"].get("deletionTimestamp"))


def as_body(raw: dict[str, Any]) -> kopf.Body:
    """An object read with `Kube` as the Body kopf.adopt and kopf.event take: the API's JSON is
    what kopf's RawBody types."""
    return kopf.Body(cast(kopf.RawBody, raw))
