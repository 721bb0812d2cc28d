"""Every pod the operator makes listens on all its addresses: no bind flag names the pod IP.

On a real node `kubectl port-forward` and `kubectl exec ... curl localhost` dial 127.0.0.1 inside
the pod; a process bound to $(POD_IP) alone refuses them. The test runtime's needs (each pod in
a network namespace of its own) are the runtime's business, never the manifests'."""

from __future__ import annotations

from kvscale.cli import build_parser
from kvscale.operator.children import owned
from kvscale.operator.children.namespace_router import NamespaceRouterValues, namespace_router
from kvscale.operator.children.router import build_router_deployment
from kvscale.operator.spec import parse_spec

BUNDLED = {"model": {"uri": "bundled://smollm2-135m-instruct"}}
BIND_FLAGS = ("--host", "--bind", "--metrics-host")


def containers(children: list[dict]) -> list[dict]:
    return [c for child in children if child["kind"] == "Deployment"
            for c in child["spec"]["template"]["spec"]["containers"]]


def bind_values(args: list[str]) -> dict[str, str]:
    """Each bind flag's value, whether spelled `--flag value` or `--flag=value`."""
    found = {}
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag in BIND_FLAGS:
            found[flag] = value if eq else args[i + 1]
    return found


def test_servers_routers_and_redis_bind_no_pod_ip():
    children = owned.build_children("chat", "team", parse_spec(BUNDLED))
    by_name = {c["name"]: c for c in containers(children)}
    assert set(by_name) >= {"server", "router", "redis"}
    for name, container in by_name.items():
        args = [*container.get("command", []), *container.get("args", [])]
        assert not any("$(POD_IP)" in a for a in args), (name, args)
    # kvscale serve and kvscale router take their default: every address.
    assert bind_values(by_name["server"]["args"]) == {}
    assert bind_values(by_name["router"]["args"]) == {}
    # Redis has no such default (protected mode aside, it binds 127.0.0.1 and ::1): every
    # IPv4 and, where the pod has it, every IPv6 address.
    assert bind_values(by_name["redis"]["args"]) == {"--bind": "* -::*"}


def test_the_parsed_command_lines_listen_on_every_address():
    children = owned.build_children("chat", "team", parse_spec(BUNDLED))
    by_name = {c["name"]: c for c in containers(children)}
    for name in ("server", "router"):
        args = build_parser(by_name[name]["args"][0]).parse_args(by_name[name]["args"])
        assert args.host is None, name  # kvscale.listen: one dual-stack socket


def test_the_servers_still_learn_their_pod_ip_for_heartbeats():
    server = next(c for c in containers(owned.build_children("chat", "team", parse_spec(BUNDLED)))
                  if c["name"] == "server")
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in server["env"]


def test_the_namespace_wide_router_binds_no_pod_ip():
    values = NamespaceRouterValues(namespace="team")
    container = build_router_deployment(namespace_router(values))["spec"]["template"]["spec"]["containers"][0]
    assert bind_values(container["args"]) == {}
    assert not any("$(POD_IP)" in a for a in container["args"])
