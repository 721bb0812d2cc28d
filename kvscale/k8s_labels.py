"""Kubernetes labels two parts agree on: the operator sets them, the router selects by them."""

from __future__ import annotations

# Every InferenceService's headless Service of servers carries it; the EndpointSlice controller
# copies a Service's labels onto its slices, which a namespace-wide router watches.
SERVERS_ENDPOINTS_LABEL = "serving.kvscale.io/endpoints"
SERVERS_ENDPOINTS_VALUE = "servers"
SERVERS_ENDPOINTS_SELECTOR = f"{SERVERS_ENDPOINTS_LABEL}={SERVERS_ENDPOINTS_VALUE}"
