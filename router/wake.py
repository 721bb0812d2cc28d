"""Waking an InferenceService at zero replicas: the router raises its scale from 0 to 1 itself.

The router holds requests only it knows about, so it asks for a replica at once, where `kubectl
scale` writes (the scale subresource), instead of waiting for the operator's next scrape. It only
ever writes 1 over 0, guarded by the scale's resourceVersion: a scale the operator (or a user)
raised meanwhile is left alone, and a 409 says someone else won. Its Role allows `get` and `patch`
on the scale subresource of its own InferenceService alone (resourceNames), nothing else of it.

The operator reads the routers' held requests too (their /health), and raises the scale on its
own at its next scrape: the fallback if this call fails (`kvscale_router_activations_total`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from kvscale.k8s_labels import (
    INFERENCE_SERVICE_GROUP,
    INFERENCE_SERVICE_PLURAL,
    INFERENCE_SERVICE_VERSION,
)
from kvscale.router.metrics import RouterMetrics

log = logging.getLogger("kvscale.router")

SCALED, ALREADY, ERROR = "scaled", "already", "error"


def scale_patch(scale: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch raising ``scale`` (a Scale object) from zero to one, or None when it is
    above zero already. The resourceVersion makes it conditional: a changed scale is a 409."""
    replicas = int((scale.get("spec") or {}).get("replicas") or 0)
    if replicas > 0:
        return None
    return {"metadata": {"resourceVersion": scale["metadata"]["resourceVersion"]},
            "spec": {"replicas": 1}}


class ScaleFromZero:
    def __init__(self, name: str, namespace: str, metrics: RouterMetrics,
                 kubeconfig: str | None = None) -> None:
        self.name = name
        self.namespace = namespace
        self.metrics = metrics
        self.kubeconfig = kubeconfig
        self._api: Any = None

    def _wake(self) -> str:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        from kvscale.router import replicas

        if self._api is None:
            self._api = client.CustomObjectsApi(replicas.kube_api_client(self.kubeconfig))
        where = (INFERENCE_SERVICE_GROUP, INFERENCE_SERVICE_VERSION, self.namespace,
                 INFERENCE_SERVICE_PLURAL, self.name)
        timeout = replicas.K8S_TIMEOUT_S  # an API server that went silent fails the call
        scale = self._api.get_namespaced_custom_object_scale(*where, _request_timeout=timeout)
        patch = scale_patch(scale)
        if patch is None:
            return ALREADY
        try:
            self._api.patch_namespaced_custom_object_scale(
                *where, patch, _content_type="application/merge-patch+json", _request_timeout=timeout)
        except ApiException as exc:
            if exc.status == 409:  # raised meanwhile by someone else
                return ALREADY
            raise
        log.info("scaled %s/%s from 0 to 1 replica: requests are held", self.namespace, self.name)
        return SCALED

    async def __call__(self) -> None:
        try:
            result = await asyncio.to_thread(self._wake)
        except Exception as exc:  # the operator's scrape is the fallback: log, count, go on
            log.warning("cannot scale %s/%s up from zero: %s", self.namespace, self.name, exc)
            result = ERROR
        self.metrics.activations.labels(result).inc()
