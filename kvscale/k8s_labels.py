"""Kubernetes names two parts agree on: the labels the operator sets and the router selects by,
and the InferenceService API the operator serves and a router scales from zero."""

from __future__ import annotations

# Every InferenceService's headless Service of servers carries it; the EndpointSlice controller
# copies a Service's labels onto its slices, which a namespace-wide router watches.
SERVERS_ENDPOINTS_LABEL = "serving.kvscale.io/endpoints"
SERVERS_ENDPOINTS_VALUE = "servers"
SERVERS_ENDPOINTS_SELECTOR = f"{SERVERS_ENDPOINTS_LABEL}={SERVERS_ENDPOINTS_VALUE}"

# The InferenceService API (the operator's CRD); a router with --scale-from-zero raises its scale.
INFERENCE_SERVICE_GROUP = "serving.kvscale.io"
INFERENCE_SERVICE_VERSION = "v1alpha1"
INFERENCE_SERVICE_PLURAL = "inferenceservices"
