"""The router, its Redis and the servers' wiring to them: pure builders, and every generated
command line parsed by the real `kvscale` argument parsers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvscale.cli import build_parser
from kvscale.operator import builders, redis_children, router_children
from kvscale.operator.spec import RouterSpec, parse_spec
from kvscale.router.policy import POLICIES

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferenceservice.yaml"
BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}


def kinds(children: list[dict]) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def expand(args: list[str], values: dict[str, str]) -> list[str]:
    """$(VAR) as the kubelet expands it, for the variables a test gives."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def test_default_service_gets_router_redis_and_rbac():
    children = builders.build_children("chat", "team", parse_spec(BUNDLED))
    assert kinds(children) == [
        ("Deployment", "chat"), ("Service", "chat"), ("Service", "chat-pods"),
        ("ServiceAccount", "chat-router"), ("Role", "chat-router"), ("RoleBinding", "chat-router"),
        ("Deployment", "chat-router"), ("PodDisruptionBudget", "chat-router"),
        ("Deployment", "chat-redis"), ("Service", "chat-redis"),
    ]
    role = next(c for c in children if c["kind"] == "Role")
    # Least privilege: reading EndpointSlices is all the router does with the API.
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]
    router = next(c for c in children if c["metadata"]["name"] == "chat-router" and c["kind"] == "Deployment")
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "chat-router"
    # Router pods must never match the servers' selector (the scale subresource's).
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert "serving.kvscale.io/inferenceservice" not in labels
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" not in container["livenessProbe"]  # /health is 503 while no server is ready


def test_router_disabled_or_external_redis_drops_those_children():
    off = parse_spec({**BUNDLED, "router": {"enabled": False}})
    assert kinds(builders.build_children("m", "ns", off)) == [
        ("Deployment", "m"), ("Service", "m"), ("Service", "m-pods")]
    assert ("apps/v1", "deployments", "m-router") in builders.unwanted_children("m", "ns", off)
    server = builders.build_deployment("m", "ns", off)["spec"]["template"]["spec"]["containers"][0]
    assert "--replica-id" not in server["args"]
    assert "KVSCALE_REDIS_URL" not in env_of(server)

    external = parse_spec({**BUNDLED, "router": {"redis": {"secretRef": {"name": "managed"}}}})
    names = kinds(builders.build_children("m", "ns", external))
    assert ("Deployment", "m-redis") not in names and ("Deployment", "m-router") in names
    assert ("v1", "secrets", "m-redis") in builders.unwanted_children("m", "ns", external)
    router = router_children.build_router_deployment("m", "ns", external, "img")
    url = env_of(router["spec"]["template"]["spec"]["containers"][0])["KVSCALE_REDIS_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "managed", "key": "url"}


def test_internal_redis_url_comes_from_the_generated_secret():
    spec = parse_spec(BUNDLED)
    env = redis_children.redis_url_env("chat", "team", spec)
    assert env[0] == {"name": "KVSCALE_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": "chat-redis", "key": "password"}}}
    # Defined after the password, so Kubernetes expands $(KVSCALE_REDIS_PASSWORD) in it.
    assert env[1] == {"name": "KVSCALE_REDIS_URL",
                      "value": "redis://:$(KVSCALE_REDIS_PASSWORD)@chat-redis.team.svc:6379/0"}
    first, second = (redis_children.build_redis_secret("chat", "team") for _ in range(2))
    assert first["stringData"]["password"] != second["stringData"]["password"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{40,}", first["stringData"]["password"])
    redis = redis_children.build_redis_deployment("chat", "team", "redis:7")
    assert redis["spec"]["strategy"] == {"type": "Recreate"}  # never two indexes at once
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in container["args"] and "$(KVSCALE_REDIS_PASSWORD)" in container["args"]


def test_generated_server_and_router_command_lines_parse_with_the_real_cli():
    spec = parse_spec({**BUNDLED, "engine": {"maxNumBatchedTokens": 512, "maxModelLen": 1024},
                       "router": {"policy": "round-robin", "balanceEpsilon": 0.5}})
    pod_values = {"POD_IP": "10.1.2.3", "POD_NAME": "chat-abc", "POD_NAMESPACE": "team"}
    server = builders.build_deployment("chat", "team", spec)["spec"]["template"]["spec"]["containers"][0]
    serve = build_parser("serve").parse_args(expand(server["args"], pod_values))
    assert (serve.host, serve.port, serve.replica_id) == ("10.1.2.3", 8000, "chat-abc")
    assert serve.max_num_batched_tokens == 512 and serve.max_model_len == 1024
    router = router_children.build_router_deployment("chat", "team", spec, "img")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser("router").parse_args(expand(args, pod_values))
    assert (parsed.host, parsed.port, parsed.k8s_service) == ("10.1.2.3", 8080, "chat-pods")
    assert parsed.namespace == "team" and parsed.k8s_port_name == "http"
    assert parsed.policy == "round-robin" and parsed.balance_epsilon == 0.5
    # Both drain within their pod's grace period, after the preStop pause.
    for container, pod_spec, parsed_args in (
            (server, builders.build_deployment("chat", "team", spec)["spec"]["template"]["spec"], serve),
            (router["spec"]["template"]["spec"]["containers"][0], router["spec"]["template"]["spec"], parsed)):
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 0 < pause + parsed_args.shutdown_timeout < pod_spec["terminationGracePeriodSeconds"]
    from kvscale.router.cli_router import config_from_args

    assert config_from_args(parsed).k8s_service == "chat-pods"


def test_router_spec_defaults_and_bad_combinations():
    assert parse_spec(BUNDLED).router == RouterSpec()
    with pytest.raises(ValueError, match="url or secretRef"):
        parse_spec({**BUNDLED, "router": {"redis": {"url": "redis://r:6379", "secretRef": {"name": "s"}}}})
    with pytest.raises(ValueError, match="redis://"):
        parse_spec({**BUNDLED, "router": {"redis": {"url": "http://r:6379"}}})


def test_crd_router_schema_matches_the_router():
    schema = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    router = schema["properties"]["spec"]["properties"]["router"]["properties"]
    assert set(router["policy"]["enum"]) == set(POLICIES)
    defaults = RouterSpec()
    assert router["enabled"]["default"] is defaults.enabled
    assert router["replicas"]["default"] == defaults.replicas
    assert router["resources"]["properties"]["cpu"]["default"] == defaults.resources.cpu
    assert router["resources"]["properties"]["memory"]["default"] == defaults.resources.memory
    assert router["redis"]["properties"]["secretRef"]["properties"]["key"]["default"] == "url"


def test_updating_the_router_rolls_the_router_not_the_servers():
    base = parse_spec(BUNDLED)
    changed = parse_spec({**BUNDLED, "router": {"policy": "round-robin", "balanceEpsilon": 1.0,
                                                "replicas": 3, "resources": {"cpu": "2"}}})
    assert builders.build_deployment("m", "ns", base) == builders.build_deployment("m", "ns", changed)
    before = router_children.build_router_deployment("m", "ns", base, "img")
    after = router_children.build_router_deployment("m", "ns", changed, "img")
    assert before["spec"]["template"] != after["spec"]["template"]
