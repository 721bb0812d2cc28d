"""A Gateway API Inference Extension InferencePool for one InferenceService, and the Service in
front of its routers' endpoint-picker port (docs/gateway.md, "From an InferenceService").

The pool selects the server pods by the label the servers' Services select them by, on the
servers' port, and names as its endpoint picker the Service `NAME-router`, whose port is the
routers' `--ext-proc-port`: a GIE gateway then asks the same routers that serve the
InferenceService's own URL which server takes each request.
"""

from __future__ import annotations

from typing import Any

from kvscale.operator.children.labels import (
    child_labels,
    router_labels,
    router_name,
    router_selector,
    selector_labels,
)
from kvscale.operator.spec import SERVER_PORT, InferenceServiceSpec

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_API_VERSION = f"{POOL_GROUP}/{POOL_VERSION}"
POOL_KIND = "InferencePool"
POOL_PLURAL = "inferencepools"
POOL_CRD = f"{POOL_PLURAL}.{POOL_GROUP}"
# The picker's container and Service port name: gRPC over cleartext HTTP/2, as GIE's pickers.
EXT_PROC_PORT_NAME = "grpc-ext-proc"


def pool_wanted(spec: InferenceServiceSpec) -> bool:
    return spec.router.enabled and spec.router.inference_pool.enabled


def ext_proc_port(spec: InferenceServiceSpec) -> int | None:
    """The routers' `--ext-proc-port`; None: they serve no endpoint picker."""
    return spec.router.inference_pool.ext_proc_port if pool_wanted(spec) else None


def ext_proc_container_port(port: int) -> dict[str, Any]:
    return {"name": EXT_PROC_PORT_NAME, "containerPort": port, "protocol": "TCP"}


def picker_service_name(name: str) -> str:
    return router_name(name)


def build_picker_service(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The Service the pool's endpointPickerRef names: the router pods' ext_proc port."""
    port = spec.router.inference_pool.ext_proc_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": picker_service_name(name), "namespace": namespace,
                     "labels": router_labels(name)},
        "spec": {
            "type": "ClusterIP",
            "selector": router_selector(name),
            # appProtocol http2: gateways speak gRPC to it in cleartext, as to GIE's own pickers.
            "ports": [{"name": EXT_PROC_PORT_NAME, "port": port, "targetPort": EXT_PROC_PORT_NAME,
                       "protocol": "TCP", "appProtocol": "http2"}],
        },
    }


def build_inference_pool(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The InferencePool `NAME`: the servers (not the routers: a gateway sends requests to the
    pod the picker names), and the routers as its picker."""
    pool = spec.router.inference_pool
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": POOL_KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": child_labels(name)},
        "spec": {
            "selector": {"matchLabels": selector_labels(name)},
            "targetPorts": [{"number": SERVER_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_service_name(name),
                "port": {"number": pool.ext_proc_port},
                "failureMode": pool.failure_mode,
            },
        },
    }
