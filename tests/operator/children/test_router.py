"""Each InferenceService's router and the servers' wiring to it: pure builders, and every
generated command line parsed by the real `kvscale` argument parsers."""

from __future__ import annotations

import re

import pytest

from kvscale.cli import build_parser
from kvscale.operator.children import owned, servers
from kvscale.operator.children.router import build_router_deployment, service_router
from kvscale.operator.spec import parse_spec
from kvscale.router.cli_router import config_from_args

BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}


def kinds(children: list[dict]) -> list[tuple[str, str]]:
    return [(c["kind"], c["metadata"]["name"]) for c in children]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def expand(args: list[str], values: dict[str, str]) -> list[str]:
    """$(VAR) as the kubelet expands it, for the variables a test gives."""
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], a) for a in args]


def test_default_service_gets_router_redis_and_rbac():
    children = owned.build_children("chat", "team", parse_spec(BUNDLED))
    assert kinds(children) == [
        ("Deployment", "chat"), ("PodDisruptionBudget", "chat"), ("Service", "chat"), ("Service", "chat-pods"),
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
    # /health is 503 while no server is ready; /ping is answered by the router's event loop.
    assert container["livenessProbe"]["httpGet"] == {"path": "/ping", "port": "http"}


def test_router_disabled_or_external_redis_drops_those_children():
    off = parse_spec({**BUNDLED, "router": {"enabled": False}})
    assert kinds(owned.build_children("m", "ns", off)) == [
        ("Deployment", "m"), ("PodDisruptionBudget", "m"), ("Service", "m"), ("Service", "m-pods")]
    assert ("apps/v1", "deployments", "m-router") in owned.unwanted_children("m", "ns", off)
    server = servers.build_deployment("m", "ns", off)["spec"]["template"]["spec"]["containers"][0]
    assert "--replica-id" not in server["args"]
    assert "KVSCALE_REDIS_URL" not in env_of(server)

    external = parse_spec({**BUNDLED, "router": {"redis": {"secretRef": {"name": "managed"}}}})
    names = kinds(owned.build_children("m", "ns", external))
    assert ("Deployment", "m-redis") not in names and ("Deployment", "m-router") in names
    assert ("apps/v1", "deployments", "m-redis") in owned.unwanted_children("m", "ns", external)
    # Never its Secret: the operator neither reads nor deletes Secrets (the GC removes it).
    assert all(plural != "secrets" for _, plural, _ in owned.unwanted_children("m", "ns", external))
    router = build_router_deployment(service_router("m", "ns", external, "img"))
    url = env_of(router["spec"]["template"]["spec"]["containers"][0])["KVSCALE_REDIS_URL"]
    assert url["valueFrom"]["secretKeyRef"] == {"name": "managed", "key": "url"}


def test_generated_server_and_router_command_lines_parse_with_the_real_cli():
    spec = parse_spec({**BUNDLED, "engine": {"maxNumBatchedTokens": 512, "maxModelLen": 1024},
                       "router": {"policy": "round-robin", "balanceEpsilon": 0.5}})
    pod_values = {"POD_IP": "10.1.2.3", "POD_NAME": "chat-abc", "POD_NAMESPACE": "team"}
    server = servers.build_deployment("chat", "team", spec)["spec"]["template"]["spec"]["containers"][0]
    serve = build_parser("serve").parse_args(expand(server["args"], pod_values))
    assert (serve.host, serve.port, serve.replica_id) == (None, 8000, "chat-abc")  # every address
    assert serve.max_num_batched_tokens == 512 and serve.max_model_len == 1024
    router = build_router_deployment(service_router("chat", "team", spec, "img"))
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser("router").parse_args(expand(args, pod_values))
    assert (parsed.host, parsed.port, parsed.k8s_service) == (None, 8080, "chat-pods")
    assert parsed.namespace == "team" and parsed.k8s_port_name == "http"
    assert parsed.policy == "round-robin" and parsed.balance_epsilon == 0.5
    # Both drain within their pod's grace period, after the preStop pause.
    for container, pod_spec, parsed_args in (
            (server, servers.build_deployment("chat", "team", spec)["spec"]["template"]["spec"], serve),
            (router["spec"]["template"]["spec"]["containers"][0], router["spec"]["template"]["spec"], parsed)):
        pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert 0 < pause + parsed_args.shutdown_timeout < pod_spec["terminationGracePeriodSeconds"]
    from kvscale.router.cli_router import config_from_args

    assert config_from_args(parsed).k8s_service == "chat-pods"


def test_updating_the_router_rolls_the_router_not_the_servers():
    base = parse_spec(BUNDLED)
    changed = parse_spec({**BUNDLED, "router": {"policy": "round-robin", "balanceEpsilon": 1.0,
                                                "replicas": 3, "resources": {"cpu": "2"}}})
    assert servers.build_deployment("m", "ns", base) == servers.build_deployment("m", "ns", changed)
    before = build_router_deployment(service_router("m", "ns", base, "img"))
    after = build_router_deployment(service_router("m", "ns", changed, "img"))
    assert before["spec"]["template"] != after["spec"]["template"]


def test_the_router_tokenizes_the_servers_model_under_the_servers_names():
    """Prefix routing for every model source: the router's --model is the servers' own path (the
    same claim mounted read-only for pvc://), and it knows the names the servers answer to."""
    pod_values = {"POD_IP": "10.1.2.3", "POD_NAME": "chat-abc", "POD_NAMESPACE": "team"}
    for model in ({"uri": "bundled://smollm2-135m-instruct", "servedName": "house-chat"},
                  {"uri": "pvc://weights/llama/3b"}, {"uri": "hf://org/tiny", "servedName": "t"}):
        spec = parse_spec({"model": model, "engine": {"blockSize": 32}})
        server_pod = servers.build_deployment("chat", "team", spec)["spec"]["template"]["spec"]
        router_pod = build_router_deployment(service_router("chat", "team", spec, "img"))["spec"]["template"]["spec"]
        serve = build_parser("serve").parse_args(expand(server_pod["containers"][0]["args"], pod_values))
        routed = build_parser("router").parse_args(expand(router_pod["containers"][0]["args"], pod_values))
        config = config_from_args(routed)
        assert config.served_model_names == serve.served_model_name == [spec.model.served_name]
        assert config.models == [serve.model] and config.block_size == serve.block_size == 32
        mounts = {m["mountPath"]: m for m in router_pod["containers"][0]["volumeMounts"]}
        if model["uri"].startswith("pvc://"):
            (claim,) = [v for v in router_pod["volumes"] if "persistentVolumeClaim" in v]
            assert claim["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
            assert mounts["/models/pvc/weights"]["readOnly"] is True
            assert serve.model.startswith("/models/pvc/weights/")
        if model["uri"].startswith("hf://"):
            (init,) = router_pod["initContainers"]
            assert init["image"] == "img" and "--include" in init["command"]
            assert "/models" in mounts
        if model["uri"].startswith("bundled://"):
            assert serve.model is None and "initContainers" not in router_pod


def test_the_router_renders_tools_in_the_servers_tool_call_format():
    """An agent's prompt carries tools and tool turns, rendered in the servers' --tool-call-parser
    format: the router must hash the same text, so it gets the same flag."""
    pod_values = {"POD_IP": "10.1.2.3", "POD_NAME": "chat-abc", "POD_NAMESPACE": "team"}
    for extra, expected in (([], "hermes"), (["--tool-call-parser", "llama3_json"], "llama3_json"),
                            (["--enable-auto-tool-choice", "--tool-call-parser=llama3_json"], "llama3_json")):
        spec = parse_spec({**BUNDLED, "engine": {"extraArgs": extra}})
        server_pod = servers.build_deployment("chat", "team", spec)["spec"]["template"]["spec"]
        router_pod = build_router_deployment(service_router("chat", "team", spec, "img"))["spec"]["template"]["spec"]
        serve = build_parser("serve").parse_args(expand(server_pod["containers"][0]["args"], pod_values))
        routed = build_parser("router").parse_args(expand(router_pod["containers"][0]["args"], pod_values))
        assert (serve.tool_call_parser or "hermes") == config_from_args(routed).tool_call_parser == expected


def test_the_router_is_told_the_servers_scheduling_policy():
    """Under --scheduling-policy priority the router sends each tenant's priority to the servers;
    under fcfs they would refuse it, so the router must know which they run."""
    pod_values = {"POD_IP": "10.1.2.3", "POD_NAME": "chat-abc", "POD_NAMESPACE": "team"}
    for extra, expected in (([], "fcfs"), (["--scheduling-policy", "priority"], "priority"),
                            (["--scheduling-policy=fcfs"], "fcfs")):
        spec = parse_spec({**BUNDLED, "engine": {"extraArgs": extra}})
        server_pod = servers.build_deployment("chat", "team", spec)["spec"]["template"]["spec"]
        router_pod = build_router_deployment(service_router("chat", "team", spec, "img"))["spec"]["template"]["spec"]
        serve = build_parser("serve").parse_args(expand(server_pod["containers"][0]["args"], pod_values))
        routed = build_parser("router").parse_args(expand(router_pod["containers"][0]["args"], pod_values))
        assert (serve.scheduling_policy or "fcfs") == config_from_args(routed).scheduling_policy == expected


def test_max_queue_wait_reaches_the_router(monkeypatch):
    monkeypatch.setenv("KVSCALE_REDIS_URL", "redis://chat-redis:6379/0")  # the pod's, from its env
    for router, expected in (({}, None), ({"maxQueueWaitSeconds": 30}, 30.0)):
        spec = parse_spec({**BUNDLED, "router": router})
        args = build_router_deployment(service_router("chat", "team", spec, "img"))["spec"]["template"]["spec"]["containers"][0]["args"]
        parsed = build_parser("router").parse_args(expand(args, {"POD_NAMESPACE": "team"}))
        assert config_from_args(parsed).max_queue_wait_s == expected
    with pytest.raises(ValueError, match="maxQueueWaitSeconds"):
        parse_spec({**BUNDLED, "router": {"maxQueueWaitSeconds": 0}})


def test_scale_to_zero_gives_the_router_a_hold_and_the_scale_of_its_own_service_alone():
    spec = parse_spec({**BUNDLED, "autoscaling": {"enabled": True, "minReplicas": 0,
                                                  "activationTimeoutSeconds": 90}})
    pod = service_router("chat", "team", spec, "img")
    args = build_router_deployment(pod)["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = build_parser("router").parse_args(
        expand(args, {"POD_NAMESPACE": "team"}))
    config = config_from_args(parsed)
    assert (config.hold_timeout_s, config.scale_from_zero) == (90.0, "chat")
    role = next(o for o in owned.build_children("chat", "team", spec)
                if o["kind"] == "Role" and o["metadata"]["name"] == "chat-router")
    scale_rules = [r for r in role["rules"] if r["apiGroups"] == ["serving.kvscale.io"]]
    assert scale_rules == [{"apiGroups": ["serving.kvscale.io"],
                            "resources": ["inferenceservices/scale"], "resourceNames": ["chat"],
                            "verbs": ["get", "patch"]}]
    # Without scale to zero: no hold, no write of any kind.
    plain = build_router_deployment(service_router("chat", "team", parse_spec(BUNDLED), "img"))
    plain_args = plain["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--hold-timeout" not in plain_args and "--scale-from-zero" not in plain_args
    plain_role = next(o for o in owned.build_children("chat", "team", parse_spec(BUNDLED))
                      if o["kind"] == "Role" and o["metadata"]["name"] == "chat-router")
    assert all(r["apiGroups"] != ["serving.kvscale.io"] for r in plain_role["rules"])


def test_servers_get_a_disruption_budget_and_spread_over_nodes_and_zones():
    children = owned.build_children("chat", "team", parse_spec(BUNDLED))
    pdb = next(c for c in children if c["kind"] == "PodDisruptionBudget" and c["metadata"]["name"] == "chat")
    assert pdb["spec"] == {"maxUnavailable": 1,
                           "selector": {"matchLabels": {"serving.kvscale.io/inferenceservice": "chat"}}}
    deployment = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat")
    assert deployment["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
    # ScheduleAnyway: one GPU node still runs every replica.
    assert all(c["whenUnsatisfiable"] == "ScheduleAnyway" and c["maxSkew"] == 1 for c in spread)
