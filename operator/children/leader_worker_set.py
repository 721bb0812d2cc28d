"""A replica over several nodes (spec.engine.nodes M > 1, docs/operator.md "A replica over
several nodes"): one LeaderWorkerSet (sigs.k8s.io/lws, v1) in place of the servers' Deployment,
and the Secret holding the key its ranks authenticate one another with.

Each of its groups is one replica: a leader pod running `kvscale serve` as any server does (HTTP,
probes, the servers' label, so the Services, the routers, the scrapes and the status see leaders
alone) and M - 1 worker pods running the same flags with `--headless`: ranks without an HTTP
server, hence without probes (a probe would have nothing to ask; the leader's own /health is
the group's, and LWS recreates the whole group when any pod of it restarts). The LWS controller
injects LWS_LEADER_ADDRESS and LWS_WORKER_INDEX into every container of its pods (its
`AddLWSVariables`, pkg/utils/pod/pod_utils.go of v0.7.0), which the kubelet expands in args.

The LeaderWorkerSet is named NAME-ranks, not NAME: its pods' DNS names (LWS_LEADER_ADDRESS is
one) live under a headless Service named like it, which LWS creates unless one of that name
exists, and NAME is the InferenceService's ClusterIP Service.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from kvscale.operator.children.labels import (
    RANKS_LABEL,
    child_labels,
    ranks_selector,
    worker_labels,
)
from kvscale.operator.children.pod_parts import secret_env, topology_spread
from kvscale.operator.children.servers import server_pod_template
from kvscale.operator.spec import InferenceServiceSpec, SecretKeyRef

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
CRD = f"{PLURAL}.leaderworkerset.x-k8s.io"
# What LWS puts in each container's environment (sigs.k8s.io/lws api/leaderworkerset/v1).
LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# The engine's shared key for its ranks' rendezvous (server/, `kvscale serve --nnodes`).
AUTHKEY_ENV = "KVSCALE_TP_AUTHKEY"
AUTHKEY_KEY = "authkey"
# torch.distributed's customary rendezvous port, named on both sides rather than left to the
# engine's default, so leader and workers agree whatever version each runs.
MASTER_PORT = 29500


def leader_worker_set_name(name: str) -> str:
    return f"{name}-ranks"


def authkey_secret_name(name: str) -> str:
    return f"{name}-tp-authkey"


def build_authkey_secret(name: str, namespace: str) -> dict[str, Any]:
    """Created once, never applied again nor read: a reconcile must not change the key of
    running ranks (as the Redis password, children/redis.py)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": authkey_secret_name(name), "namespace": namespace,
                     "labels": child_labels(name)},
        "type": "Opaque",
        "stringData": {AUTHKEY_KEY: secrets.token_urlsafe(32)},
    }


def rank_args(spec: InferenceServiceSpec, node_rank: str) -> list[str]:
    """Where one pod's ranks sit in its replica: M nodes, this one's rank, the leader's address."""
    return ["--nnodes", str(spec.engine.nodes), "--node-rank", node_rank,
            "--master-addr", f"$({LEADER_ADDRESS_ENV})", "--master-port", str(MASTER_PORT)]


def with_authkey(template: dict[str, Any], name: str) -> dict[str, Any]:
    container = template["spec"]["containers"][0]
    container["env"] = [*container["env"],
                        secret_env(AUTHKEY_ENV, SecretKeyRef(authkey_secret_name(name), AUTHKEY_KEY))]
    return template


def leader_template(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    template = server_pod_template(name, namespace, spec, rank_args(spec, "0"))
    template["metadata"]["labels"] = {**template["metadata"]["labels"], RANKS_LABEL: name}
    return with_authkey(template, name)


def worker_template(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """The leader's pod with `--headless` and the worker's rank, less what only an HTTP server
    has: its port, probes, preStop sleep (no endpoint to leave), scrape annotations and the
    servers' labels."""
    template = copy.deepcopy(server_pod_template(
        name, namespace, spec, [*rank_args(spec, f"$({WORKER_INDEX_ENV})"), "--headless"]))
    template["metadata"] = {"labels": worker_labels(name)}
    pod = template["spec"]
    pod["topologySpreadConstraints"] = topology_spread(ranks_selector(name))
    container = pod["containers"][0]
    container["name"] = "worker"
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        container.pop(key, None)
    return with_authkey(template, name)


def build_leader_worker_set(name: str, namespace: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    """spec.replicas groups of engine.nodes pods, one replica each."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": leader_worker_set_name(name), "namespace": namespace,
                     "labels": child_labels(name)},
        "spec": {
            "replicas": spec.replicas,
            # The workers start with the leader, not once it is ready: it is ready only when
            # they have joined (its HTTP server comes up after every rank loaded its shard).
            "startupPolicy": "LeaderCreated",
            # A new group ready before an old one goes: keep serving through rollouts.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
            "leaderWorkerTemplate": {
                "size": spec.engine.nodes,
                # A rank that restarts cannot rejoin its group's running collectives.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader_template(name, namespace, spec),
                "workerTemplate": worker_template(name, namespace, spec),
            },
        },
    }
