"""The objects the operator makes, as plain dicts built from typed values (pure functions).

- `labels`: names, labels and selectors of every part (servers, router, Redis), in one place.
- `pod_parts`: what every pod shares: security contexts, probes, the downward-API environment,
  the API key's environment, preStop and the drain's share of the grace period.
- `servers`: the `kvscale serve` Deployment, the InferenceService's Service and the headless one.
- `router`: a `kvscale router` Deployment with its RBAC and PodDisruptionBudget, for one
  InferenceService or, through `namespace_router`, for every one of a namespace (the chart's).
- `redis`: the Redis of one InferenceService's KV index and the environment giving pods its URL.
- `owned`: everything one InferenceService owns, and what its spec no longer wants.

The operator server-side-applies exactly these objects, so what they leave out is left to the API
server's defaults (and to other field managers) rather than fought over.
"""
