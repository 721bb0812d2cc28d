"""The chart's pods listen on every address of the pod: no bind flag names $(POD_IP), so
`kubectl port-forward` (a dial to localhost inside the pod) reaches them on a real node."""

from __future__ import annotations

import pytest
from chart_helpers import ALL_ON

pytestmark = pytest.mark.slow  # helm comes with the Go-built control plane

BIND_FLAGS = ("--host", "--bind", "--metrics-host")


def pod_containers(docs: list[dict]) -> list[tuple[str, dict]]:
    found = []
    for doc in docs:
        spec = (doc["spec"]["template"]["spec"] if doc["kind"] == "Deployment"
                else doc["spec"] if doc["kind"] == "Pod" else None)
        for container in (spec or {}).get("containers", []):
            found.append((f"{doc['kind']}/{doc['metadata']['name']}", container))
    return found


def test_no_rendered_pod_binds_its_pod_ip(helm):
    containers = pod_containers(helm.template(*ALL_ON))
    names = {where for where, _ in containers}
    assert {"Deployment/kvscale-operator", "Deployment/kvscale-router"} <= names, names
    for where, container in containers:
        args = [*container.get("command", []), *container.get("args", [])]
        for i, arg in enumerate(args):
            flag = arg.partition("=")[0]
            assert flag not in BIND_FLAGS, (where, args[i:i + 2])
        assert not any("$(POD_IP)" in a for a in args), (where, args)


def test_the_operator_no_longer_needs_its_pod_ip(helm):
    operator = next(d for d in helm.template() if d["kind"] == "Deployment")
    env = {e["name"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "POD_IP" not in env  # nothing in the operator reads it
