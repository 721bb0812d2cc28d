"""The namespace-wide router (`kvscale operator render-router`): the per-InferenceService
router's pod but for what it routes to and its values, and a command line the real router
parser takes."""

from __future__ import annotations

import re

import yaml

from kvscale.cli import build_parser, main
from kvscale.operator.children.namespace_router import (
    NamespaceRouterValues,
    namespace_router,
    namespace_router_objects,
)
from kvscale.operator.children.router import build_router_deployment, service_router
from kvscale.operator.spec import RedisSource, SecretKeyRef, parse_spec

POD_VALUES = {"POD_IP": "10.1.2.3", "POD_NAME": "router-abc", "POD_NAMESPACE": "team"}


def pod_of(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def values() -> NamespaceRouterValues:
    return NamespaceRouterValues(namespace="team", redis=RedisSource(url="redis://r:6379/0"),
                                 api_key_secret=SecretKeyRef("key"), policy="round-robin")


def test_its_command_line_parses_and_drains_within_its_grace_period():
    deployment = build_router_deployment(namespace_router(values()))
    container = pod_of(deployment)["containers"][0]
    args = [re.sub(r"\$\((\w+)\)", lambda m: POD_VALUES[m.group(1)], a) for a in container["args"]]
    parsed = build_parser("router").parse_args(args)
    assert parsed.k8s_namespace_wide and parsed.namespace == "team" and parsed.k8s_service is None
    assert (parsed.host, parsed.port, parsed.policy) == (None, 8080, "round-robin")  # every address
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert 0 < pause + parsed.shutdown_timeout < pod_of(deployment)["terminationGracePeriodSeconds"]
    env = {e["name"]: e for e in container["env"]}
    assert env["KVSCALE_REDIS_URL"]["value"] == "redis://r:6379/0"
    for name in ("KVSCALE_API_KEY", "KVSCALE_REPLICA_API_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "key", "key": "api-key"}
    assert env["HOME"]["value"] == "/tmp"  # a writable home for the tokenizer on a read-only root


def test_its_pod_is_the_per_service_routers_pod():
    """Only what it routes to (and so which tokenizer it knows), its index, its key and its
    resources differ."""
    ours = pod_of(build_router_deployment(namespace_router(NamespaceRouterValues())))
    spec = parse_spec({"model": {"uri": "bundled://smollm2-135m-instruct"}})
    theirs = pod_of(build_router_deployment(service_router("chat", "team", spec, ours["containers"][0]["image"])))

    def common(pod: dict) -> dict:
        container = {k: v for k, v in pod["containers"][0].items() if k not in ("args", "env", "resources")}
        return {**{k: v for k, v in pod.items()
                   if k not in ("containers", "serviceAccountName", "topologySpreadConstraints")},
                "container": container}

    assert common(ours) == common(theirs)
    # Both spread over nodes and zones, each over its own pods.
    for pod, selector in ((ours, dict(namespace_router(NamespaceRouterValues()).selector)),
                          (theirs, {"serving.kvscale.io/router": "chat"})):
        spread = pod["topologySpreadConstraints"]
        assert [c["topologyKey"] for c in spread] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
        assert all(c["labelSelector"] == {"matchLabels": selector} for c in spread)
    drop_discovery = {"--k8s-service", "chat-pods", "--k8s-namespace-wide", "--namespace", "default",
                      "$(POD_NAMESPACE)", "--policy", "predicted-ttft",
                      "--served-model-name", "smollm2-135m-instruct", "--block-size", "16"}
    assert ([a for a in ours["containers"][0]["args"] if a not in drop_discovery]
            == [a for a in theirs["containers"][0]["args"] if a not in drop_discovery])


def test_it_may_only_read_and_gets_a_pdb_only_with_replicas_to_spare(capsys):
    objects = namespace_router_objects(namespace_router(values()), "ClusterIP", 80)
    role = next(o for o in objects if o["kind"] == "Role")
    assert {r["resources"][0] for r in role["rules"]} == {"endpointslices", "pods", "inferenceservices"}
    assert all(r["verbs"] == ["get", "list", "watch"] for r in role["rules"])
    assert main(["operator", "render-router", "--namespace", "team", "--replicas", "1"]) == 0
    printed = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in printed] == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert {d["metadata"]["namespace"] for d in printed} == {"team"}
