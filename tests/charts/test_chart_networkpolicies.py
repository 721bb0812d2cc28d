"""The chart's NetworkPolicies against the labels of the pods they are about, for every
combination of what an InferenceService exposes (router on or off, the operator's Redis or an
external one) and of the namespace-wide router (on or off); and the routers' endpoint-picker port and
the InferencePool's servers, open to the configured gateway only.

The pods are those the operator's builders make (operator/children) and those the chart renders
(the operator, the namespace-wide router, the `helm test` pod); the policies are
`helm template`'s. Who may reach whom is decided here by NetworkPolicy's own rules (a pod no
Ingress policy selects admits everything; otherwise the union of the rules of those that do), both
as the chart leaves a namespace and beside a namespace's default-deny policy, which the chart's
policies must survive.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from chart_helpers import Helm

from kvscale.operator.children.owned import build_children
from kvscale.operator.spec import EXT_PROC_PORT, REDIS_PORT, ROUTER_PORT, SERVER_PORT, parse_spec

RELEASE = "kvscale"
RELEASE_NS = "kvscale-system"
SERVICES_NS = "team"  # where the InferenceServices run (networkPolicies.namespaces)
CLIENTS_NS = "clients"
MONITORING_NS = "monitoring"
GATEWAYS_NS = "gateways"
BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: tuple[tuple[str, int], ...] = ()  # named container ports, which a policy may name


def namespace_labels(name: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name}


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector as the API defines it (an empty one selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], source: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        return False  # pod-to-pod traffic here
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels(source.namespace)):
            return False
    elif source.namespace != policy_ns:
        return False  # a podSelector alone means the policy's own namespace
    return selects(peer.get("podSelector"), source.labels)


def admitted(policies: list[dict[str, Any]], source: Pod, target: Pod, port: int) -> bool:
    applying = [p for p in policies if p["metadata"]["namespace"] == target.namespace
                and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
                and selects(p["spec"]["podSelector"], target.labels)]
    if not applying:
        return True
    for policy in applying:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p.get("port") in (port, *(n for n, number in target.ports if number == port))
                                 for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(peer_admits(peer, source, target.namespace) for peer in peers):
                return True
    return False


def template_labels(doc: dict[str, Any]) -> dict[str, str]:
    return dict(doc["spec"]["template"]["metadata"]["labels"])


def template_ports(doc: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    return tuple((p["name"], p["containerPort"]) for c in doc["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports") or [] if "name" in p)


def built_pods(name: str, spec: dict[str, Any]) -> dict[str, Pod]:
    """The pods of one InferenceService, by part, with the labels and ports the operator gives them."""
    parts = {"": "servers", "-router": "router", "-redis": "redis"}
    pods = {}
    for child in build_children(name, SERVICES_NS, parse_spec({**BUNDLED, **spec})):
        if child["kind"] == "Deployment":
            part = parts[child["metadata"]["name"][len(name):]]
            pods[part] = Pod(f"{child['metadata']['name']}-pod", SERVICES_NS, template_labels(child),
                             template_ports(child))
    return pods


COMBINATIONS = list(itertools.product([True, False], [True, False], [False, True]))


@pytest.mark.parametrize(("router", "namespace_router", "external_redis"), COMBINATIONS,
                         ids=[f"router-{'on' if r else 'off'}-nsrouter-{'on' if n else 'off'}-"
                              f"{'external' if e else 'own'}-redis" for r, n, e in COMBINATIONS])
@pytest.mark.parametrize("default_deny", [False, True], ids=["open-namespaces", "default-deny"])
def test_policies_follow_what_each_inference_service_exposes(helm: Helm, router, namespace_router,
                                                              external_redis, default_deny):
    values = ["networkPolicies.enabled=true", f"networkPolicies.namespaces={{{SERVICES_NS}}}",
              "tests.inferenceService=chat", f"tests.namespace={SERVICES_NS}"]
    if namespace_router:
        values += ["namespaceRouter.enabled=true", f"namespaceRouter.namespace={SERVICES_NS}",
                   "namespaceRouter.redis.url=redis://kv-index.team.svc:6379/0"]
    docs = helm.template(*values, release=RELEASE, namespace=RELEASE_NS)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if default_deny:
        policies += [{"metadata": {"name": "deny", "namespace": ns},
                      "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
                     for ns in (SERVICES_NS, RELEASE_NS)]
    spec: dict[str, Any] = {"router": {"enabled": router}}
    if external_redis:
        spec["router"]["redis"] = {"url": "redis://shared.team.svc:6379/0"}
    pods = built_pods("chat", spec)
    assert ("router" in pods) == router and ("redis" in pods) == (router and not external_redis)

    (operator,) = [d for d in docs if d["kind"] == "Deployment"
                   and d["metadata"]["name"] == f"{RELEASE}-operator"]
    operator_pod = Pod("operator", RELEASE_NS, template_labels(operator))
    (helm_test,) = [d for d in docs if d["kind"] == "Pod" and "metrics" in d["metadata"]["name"]]
    helm_test_pod = Pod("helm-test", SERVICES_NS, dict(helm_test["metadata"]["labels"]))
    client = Pod("client", CLIENTS_NS, {"app": "chat-ui"})
    neighbour = Pod("neighbour", SERVICES_NS, {"app": "something-else"})
    prometheus = Pod("prometheus", MONITORING_NS, {"app.kubernetes.io/name": "prometheus"})
    namespace_router_pod = None
    if namespace_router:
        (nsr,) = [d for d in docs if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == f"{RELEASE}-router"]
        namespace_router_pod = Pod("namespace-router", SERVICES_NS, template_labels(nsr))

    def can(source: Pod, target: Pod, port: int) -> bool:
        return admitted(policies, source, target, port)

    servers = pods["servers"]
    # Whoever reads a server's /metrics: the operator (autoscaler), Prometheus, the helm test.
    for scraper in (operator_pod, prometheus, helm_test_pod):
        assert can(scraper, servers, SERVER_PORT), scraper.name
    if router:
        # The router is the OpenAI ingress: clients, Prometheus and the operator (/health) reach it;
        # the servers behind it are reached through it only.
        for source in (client, neighbour, prometheus, operator_pod):
            assert can(source, pods["router"], ROUTER_PORT), source.name
        assert can(pods["router"], servers, SERVER_PORT)
        assert not can(client, servers, SERVER_PORT)
        assert not can(neighbour, servers, SERVER_PORT)
    else:
        # No router: the servers are the InferenceService's endpoint, open to its clients.
        assert servers.labels.get("serving.kvscale.io/client-facing") == "true"
        assert can(client, servers, SERVER_PORT)
        assert can(neighbour, servers, SERVER_PORT)
    if "redis" in pods:
        assert can(pods["router"], pods["redis"], REDIS_PORT)
        assert can(servers, pods["redis"], REDIS_PORT)
        for source in (client, neighbour, prometheus, operator_pod):
            assert not can(source, pods["redis"], REDIS_PORT), source.name
    if namespace_router_pod is not None:
        # Scraped and reached as the per-service routers are; it reaches every server.
        for source in (client, neighbour, prometheus, operator_pod):
            assert can(source, namespace_router_pod, ROUTER_PORT), source.name
        assert can(namespace_router_pod, servers, SERVER_PORT)


def test_policies_cover_the_namespaces_the_operator_serves(helm: Helm):
    """Without networkPolicies.namespaces, the namespaces the operator watches; a cluster-wide
    operator's cannot be known, and NOTES.txt says to list them."""
    docs = helm.template("networkPolicies.enabled=true", "operator.watchNamespaces={team,lab}",
                         release=RELEASE, namespace=RELEASE_NS)
    covered = {d["metadata"]["namespace"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert covered == {"team", "lab"}
    listed = helm.template("networkPolicies.enabled=true", "networkPolicies.namespaces={a}",
                           "operator.watchNamespaces={team}", release=RELEASE, namespace=RELEASE_NS)
    assert {d["metadata"]["namespace"] for d in listed if d["kind"] == "NetworkPolicy"} == {"a"}


def test_only_the_gateway_reaches_the_endpoint_picker_and_the_pool_servers(helm: Helm):
    """spec.router.inferencePool's picker port (a named container port, whatever its number) and
    its servers' HTTP port (the gateway sends each request to the server the picker names) admit
    networkPolicies.gateway, and the gateway nothing else: not other servers, not Redis. While the
    chart's inferencePool.enabled is false neither admits it, and nothing else differs."""
    base = ["networkPolicies.enabled=true", f"networkPolicies.namespaces={{{SERVICES_NS}}}"]
    custom_port = EXT_PROC_PORT + 98
    picker = built_pods("chat", {"router": {"inferencePool": {"enabled": True}}})
    moved = built_pods("code", {"router": {"inferencePool": {"enabled": True, "extProcPort": custom_port}}})
    plain = built_pods("docs", {})
    direct = built_pods("bare", {"router": {"enabled": False}})  # client-facing servers
    pickers = ((picker["router"], EXT_PROC_PORT), (moved["router"], custom_port))
    pool_servers = (picker["servers"], moved["servers"])
    gateway_label = {"gateway.networking.k8s.io/gateway-name": "inference-gateway"}
    local_gateway = Pod("gateway", SERVICES_NS, gateway_label)
    other_gateway = Pod("envoy", GATEWAYS_NS, {"app": "envoy", **gateway_label})
    others = [Pod("client", CLIENTS_NS, {"app": "chat-ui"}), Pod("neighbour", SERVICES_NS, {"app": "x"}),
              Pod("prometheus", MONITORING_NS, {"app.kubernetes.io/name": "prometheus"}),
              picker["servers"], plain["router"]]
    deny = [{"metadata": {"name": "deny", "namespace": SERVICES_NS},
             "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}]
    kvscale_pods = [*picker.values(), *moved.values(), *plain.values(), *direct.values()]
    ports = (SERVER_PORT, ROUTER_PORT, REDIS_PORT, EXT_PROC_PORT, custom_port)

    def policies(*values: str) -> list[dict[str, Any]]:
        docs = helm.template(*base, *values, release=RELEASE, namespace=RELEASE_NS,
                             show_only=["templates/networkpolicies.yaml"])
        return [d for d in docs if d["kind"] == "NetworkPolicy"] + deny

    def reaches_a_picker(rendered: list[dict[str, Any]], source: Pod) -> bool:
        return any(admitted(rendered, source, router, port) for router, port in pickers)

    def reaches_a_pool_server(rendered: list[dict[str, Any]], source: Pod) -> bool:
        return any(admitted(rendered, source, servers, SERVER_PORT) for servers in pool_servers)

    assert all(s.labels.get("serving.kvscale.io/inference-pool") == "true" for s in pool_servers)
    for servers in (plain["servers"], direct["servers"]):
        assert "serving.kvscale.io/inference-pool" not in servers.labels

    # Defaults: the Gateway API implementation's pods of the InferenceService's own namespace.
    rendered = policies()
    for router, port in pickers:
        assert admitted(rendered, local_gateway, router, port), router.name
        assert admitted(rendered, local_gateway, router, ROUTER_PORT)  # the OpenAI port, as for anyone
    for servers in pool_servers:
        assert admitted(rendered, local_gateway, servers, SERVER_PORT), servers.name
        assert not admitted(rendered, local_gateway, servers, ROUTER_PORT)  # their HTTP port only
    assert not admitted(rendered, local_gateway, plain["router"], EXT_PROC_PORT)  # no picker, no port
    assert not admitted(rendered, local_gateway, plain["servers"], SERVER_PORT)  # no pool, no entry
    for redis in (picker["redis"], moved["redis"], plain["redis"]):
        assert not admitted(rendered, local_gateway, redis, REDIS_PORT), redis.name
    assert not reaches_a_picker(rendered, other_gateway)
    assert not reaches_a_pool_server(rendered, other_gateway)
    for source in others:
        assert not reaches_a_picker(rendered, source), source.name

    # The chart's pool off: closed to the gateway, and every other path as with it on.
    closed = policies("inferencePool.enabled=false")
    for source in (local_gateway, other_gateway, *others):
        assert not reaches_a_picker(closed, source), source.name
    assert not reaches_a_pool_server(closed, local_gateway)
    opened = {(servers.name, SERVER_PORT) for servers in pool_servers} | {(r.name, p) for r, p in pickers}
    for source in (local_gateway, other_gateway, *others, *kvscale_pods):
        for target in kvscale_pods:
            for port in ports:
                if source is local_gateway and (target.name, port) in opened:
                    continue
                assert admitted(rendered, source, target, port) == admitted(closed, source, target, port), (
                    source.name, target.name, port)

    # A gateway of another namespace, as the values name it; the local look-alike is then out.
    rendered = policies(f"networkPolicies.gateway.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name={GATEWAYS_NS}",
                        "networkPolicies.gateway.podSelector.matchLabels.app=envoy")
    for router, port in pickers:
        assert admitted(rendered, other_gateway, router, port), router.name
    for servers in pool_servers:
        assert admitted(rendered, other_gateway, servers, SERVER_PORT), servers.name
    assert not admitted(rendered, other_gateway, plain["servers"], SERVER_PORT)
    assert not reaches_a_picker(rendered, local_gateway)
    assert not reaches_a_pool_server(rendered, local_gateway)
    for source in others:
        assert not reaches_a_picker(rendered, source), source.name


def test_the_ranks_of_a_replica_over_several_nodes_reach_one_another_alone(helm: Helm):
    """engine.nodes > 1: a LeaderWorkerSet's leader and workers reach one another on any port
    (rendezvous, step messages, NCCL); the leader is reached as any server is, and a worker, which
    serves nothing, by the ranks alone."""
    docs = helm.template("networkPolicies.enabled=true", f"networkPolicies.namespaces={{{SERVICES_NS}}}",
                         release=RELEASE, namespace=RELEASE_NS)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    spec = parse_spec({**BUNDLED, "resources": {"gpus": 1}, "engine": {"nodes": 3}})
    [lws] = [c for c in build_children("chat", SERVICES_NS, spec) if c["kind"] == "LeaderWorkerSet"]
    templates = lws["spec"]["leaderWorkerTemplate"]
    leader = Pod("chat-ranks-0", SERVICES_NS, dict(templates["leaderTemplate"]["metadata"]["labels"]),
                 (("http", SERVER_PORT),))
    worker = Pod("chat-ranks-0-1", SERVICES_NS, dict(templates["workerTemplate"]["metadata"]["labels"]))
    other_worker = Pod("chat-ranks-0-2", SERVICES_NS, worker.labels)
    router = built_pods("chat", {})["router"]
    client = Pod("client", CLIENTS_NS, {"app": "chat-ui"})
    neighbour = Pod("neighbour", SERVICES_NS, {"app": "something-else"})
    for port in (29500, 29501, 41234):  # the master port, the next one, an NCCL socket
        assert admitted(policies, worker, leader, port)
        assert admitted(policies, leader, worker, port)
        assert admitted(policies, other_worker, worker, port)
        for source in (router, client, neighbour):
            assert not admitted(policies, source, worker, port), (source.name, port)
            assert not admitted(policies, source, leader, port), (source.name, port)
    assert admitted(policies, router, leader, SERVER_PORT)
    assert not admitted(policies, client, leader, SERVER_PORT)
    off = helm.template("networkPolicies.enabled=true", f"networkPolicies.namespaces={{{SERVICES_NS}}}",
                        "leaderWorkerSet.enabled=false", release=RELEASE, namespace=RELEASE_NS)
    assert not [d for d in off if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-ranks")]
