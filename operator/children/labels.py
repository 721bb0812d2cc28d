"""Names, labels and selectors of the objects the operator makes, for every part in one place.

Each part's pods are selected by a label of its own holding the InferenceService's name
(`serving.kvscale.io/inferenceservice`, `/router`, `/redis`), so no selector ever matches another
part's pods: the servers' one is the scale subresource's, which must never count a router.
The chart's NetworkPolicies and PodMonitors select by `component` and `managed-by` below.
"""

from __future__ import annotations

from kvscale.operator.spec import NAME_LABEL

ROUTER_LABEL = "serving.kvscale.io/router"
REDIS_LABEL = "serving.kvscale.io/redis"
MANAGED_BY = "kvscale-operator"
SERVER_COMPONENT = "inference-server"
ROUTER_COMPONENT = "router"
REDIS_COMPONENT = "kv-index"
# On the pods clients reach directly: the servers of an InferenceService without a router (its
# Service selects them). The chart's NetworkPolicies admit every client to these alone.
CLIENT_FACING_LABEL = "serving.kvscale.io/client-facing"
# On the servers of an InferenceService with an InferencePool (spec.router.inferencePool): a
# gateway connects to them directly, to the pod the endpoint picker names, and the chart's
# NetworkPolicies admit the gateway to these servers alone (docs/gateway.md, "NetworkPolicies").
INFERENCE_POOL_LABEL = "serving.kvscale.io/inference-pool"
# On every pod of a replica over several nodes (engine.nodes > 1), its leader and its workers:
# the PodDisruptionBudget counts them all (a worker evicted restarts its whole group), and the
# chart's NetworkPolicies let them reach one another. Only a leader also has the servers' own
# label: the workers serve no HTTP, so no Service, router, scrape or status ever selects one.
RANKS_LABEL = "serving.kvscale.io/ranks"
WORKER_COMPONENT = "inference-server-worker"


def part_labels(selector: dict[str, str], instance: str, component: str) -> dict[str, str]:
    """The labels of one part's objects and pods: its selector and the recommended labels."""
    return {
        **selector,
        "app.kubernetes.io/name": "kvscale",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


# --- servers (`kvscale serve`) ----------------------------------------------------------------


def selector_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: name}


def child_labels(name: str) -> dict[str, str]:
    return part_labels(selector_labels(name), name, SERVER_COMPONENT)


def ranks_selector(name: str) -> dict[str, str]:
    """Every pod of a replica over several nodes: leaders and workers."""
    return {RANKS_LABEL: name}


def worker_labels(name: str) -> dict[str, str]:
    """The pods of a replica over several nodes but its leader: ranks without an HTTP server."""
    return part_labels(ranks_selector(name), name, WORKER_COMPONENT)


def as_selector_string(labels: dict[str, str]) -> str:
    """A label selector in the string form the API takes and the scale subresource reports."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def selector_string(name: str) -> str:
    """The servers' selector."""
    return as_selector_string(selector_labels(name))


def headless_service_name(name: str) -> str:
    return f"{name}-pods"


def service_url(name: str, namespace: str, cluster_domain: str = "cluster.local") -> str:
    """The Service named like the InferenceService: the router's, or the servers' without one."""
    return f"http://{name}.{namespace}.svc.{cluster_domain}"


# --- the router -------------------------------------------------------------------------------


def router_name(name: str) -> str:
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    return {ROUTER_LABEL: name}


def router_labels(name: str) -> dict[str, str]:
    return part_labels(router_selector(name), name, ROUTER_COMPONENT)


# --- Redis --------------------------------------------------------------------------------------


def redis_name(name: str) -> str:
    return f"{name}-redis"


def redis_selector(name: str) -> dict[str, str]:
    return {REDIS_LABEL: name}


def redis_labels(name: str) -> dict[str, str]:
    return part_labels(redis_selector(name), name, REDIS_COMPONENT)


def redis_host(name: str, namespace: str) -> str:
    # Namespace-qualified but without the cluster domain, so it resolves whatever the domain is.
    return f"{redis_name(name)}.{namespace}.svc"
